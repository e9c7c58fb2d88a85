"""The sections of benchmarks/gpu_suite.py, one file each."""
