"""Optimizer over flat buffers (plain or ZeRO-sharded; fp32, or bf16 with fp32 master weights), fp16 loss
scaling, LR schedule, exact clipping."""
from megaft.optim.adamw import AdamW
from megaft.optim.clip import clip_grad_norm_, grad_norm
from megaft.optim.config import OptimConfig, check_optim
from megaft.optim.scaler import LossScaler
from megaft.optim.schedule import lr_at
from megaft.optim.zero import ShardedAdamW, build_optimizer
from megaft.parallel.flat import FlatParams

__all__ = ["AdamW", "FlatParams", "LossScaler", "OptimConfig", "ShardedAdamW", "build_optimizer", "check_optim",
           "clip_grad_norm_", "grad_norm", "lr_at"]
