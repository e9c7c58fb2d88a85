"""The vision side of a step: encoder cache, runner, CUDA graphs, remote sources."""
