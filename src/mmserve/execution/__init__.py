"""Execution stage of mmserve."""
