"""Disaggregation stage of mmserve."""
