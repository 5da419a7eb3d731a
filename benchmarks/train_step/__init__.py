"""End-to-end train step: torch paths vs the fused kernels (``python -m benchmarks.train_step``)."""
