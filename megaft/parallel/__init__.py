"""Process groups (ParallelGrid), autograd-aware collectives and their config."""
from megaft.parallel.config import ParallelConfig, check_parallel
from megaft.parallel.grid import Axis, ParallelGrid

__all__ = ["Axis", "ParallelConfig", "ParallelGrid", "check_parallel"]
