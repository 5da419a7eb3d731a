"""Pipeline schedule benchmarks: ``python -m benchmarks.pipeline --simulate``."""
