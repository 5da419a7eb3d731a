"""The optimizer's math: AdamW over flat buffers (fp32, or bf16 with fp32 master weights; its
multi-tensor update is shared by the ZeRO-sharded optimizer of megaft.parallel.data), host
offload, fp16 loss scaling, LR schedule, exact clipping."""
from megaft.config.optim import OptimConfig, check_optim
from megaft.optim.adamw import AdamW
from megaft.optim.clip import clip_grad_norm_, grad_norm
from megaft.optim.scaler import LossScaler
from megaft.optim.schedule import lr_at

__all__ = ["AdamW", "LossScaler", "OptimConfig", "check_optim", "clip_grad_norm_", "grad_norm", "lr_at"]
