"""Serving benchmark client for any OpenAI-compatible chat completions server."""
