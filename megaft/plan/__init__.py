"""Layout planning (`megaft-plan`): the config every layout is applied to (`shape.py`), the
search space (`space.py`), the report (`report.py`) and the Hydra app (`app.py`); the cluster
presets are conf/cluster/ (megaft.config.cluster), the cost model megaft.perf.

Import the submodules directly; this package imports nothing.
"""
