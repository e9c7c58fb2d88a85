"""Sampling one step: rows, penalties, grammar masks, the draw, logprobs, one host copy."""
