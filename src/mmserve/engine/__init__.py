"""Engine stage of mmserve."""
