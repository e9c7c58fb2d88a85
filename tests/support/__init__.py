"""Builders, harnesses and stand-ins the tests share; no test module imports another."""
