"""Tensor parallelism across processes: the executor, its ranks' processes and their meeting."""
