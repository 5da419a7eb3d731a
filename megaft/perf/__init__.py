"""megaft's one performance model.

counts.py    parameters, FLOPs per token, activation and message bytes of a block
memory.py    the per-GPU memory estimate validate() checks against the budget
time.py      the predicted step time of a layout (megaft-plan's cost model)
hardware.py  the one table of devices: peaks, HBM, memory (MFU, budgets, cluster presets)

No module outside this package counts FLOPs or bytes of a model (tests/test_layering.py).
"""
