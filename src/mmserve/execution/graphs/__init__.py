"""CUDA graphs of the runner: capture and replay (`capture.py`), the decode graphs (`decode.py`)."""
