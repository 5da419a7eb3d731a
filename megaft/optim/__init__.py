"""Optimizer over flat fp32 buffers, LR schedule and tensor-parallel-exact clipping."""
from megaft.optim.adamw import AdamW
from megaft.optim.clip import clip_grad_norm_, grad_norm
from megaft.optim.config import OptimConfig, check_optim
from megaft.optim.flat import FlatParams
from megaft.optim.schedule import lr_at

__all__ = ["AdamW", "FlatParams", "OptimConfig", "check_optim", "clip_grad_norm_", "grad_norm", "lr_at"]
