"""Kernel microbenchmarks, one module per kernel family and device."""
