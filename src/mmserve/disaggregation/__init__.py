"""Encode/prefill disaggregation: the `mmserve encode` server, the language-model side's pool
client, and the messages between them (see docs/disaggregation.md)."""
