"""Optimizer step time on the device vs offloaded to the host (parallel.offload=cpu)."""
