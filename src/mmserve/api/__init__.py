"""Api stage of mmserve."""
