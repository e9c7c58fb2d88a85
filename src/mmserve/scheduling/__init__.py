"""Scheduling stage of mmserve."""
