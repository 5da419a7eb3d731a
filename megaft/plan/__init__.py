"""Layout planning (`megaft-plan`): hardware tables (conf/cluster/, `config.py`), the
search space (`space.py`), the cost model (`cost.py`) and the Hydra app (`app.py`).

Import the submodules directly; this package imports nothing, so that the config layer
can import `megaft.plan.config` without pulling in the planner.
"""
