"""Processing stage of mmserve."""
