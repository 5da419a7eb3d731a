"""Benchmarks: kernels, pipeline and end-to-end runs (not tests). Run modules with
``python -m benchmarks.<path>``; each validates against its reference first."""
