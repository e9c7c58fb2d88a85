"""Models stage of mmserve."""
