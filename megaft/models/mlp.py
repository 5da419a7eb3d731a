"""The dense gated MLP of the decoder block (SwiGLU / GeGLU), tensor parallel over `group`; also
a mixture of experts' shared expert (megaft.models.moe)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.kernels.linear import fused_gate_up
from megaft.kernels.linear.fused import fused_gate_up_swiglu
from megaft.kernels.swiglu import swiglu
from megaft.layers import ColumnParallelLinear, RowParallelLinear
from megaft.layers.linear import column_input, column_outputs
from megaft.models import recompute
from megaft.models.attention.gqa import op_backend
from megaft.parallel.comm import Group


class MLP(nn.Module):
    """Gated MLP down(act(gate(x)) * up(x)), gate/up split by columns, down by rows:
    SwiGLU (act silu, through the swiglu kernels) or GeGLU (gelu_pytorch_tanh, Gemma:
    torch ops, the SwiGLU kernels do not apply). `selective`: the activation runs again in
    backward (recompute=selective). `overlap`: parallel.tp_overlap=ring (one ring for gate/up,
    one for down: megaft.layers.linear; the fused gate/up kernel then does not apply)."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None, selective: bool = False, overlap: bool = False):
        super().__init__()
        self.group, self.sp, self.swiglu_backend = group, sequence_parallel, op_backend(kernels, "swiglu")
        self.activation = cfg.activation
        self.selective = selective
        lin = op_backend(kernels, "linear")
        col = dict(group=group, bias=cfg.mlp_bias, sequence_parallel=sequence_parallel, shared_input=True,
                   backend=lin, overlap=overlap)
        self.gate_proj = ColumnParallelLinear(cfg.dim, cfg.ffn_dim, **col)
        self.up_proj = ColumnParallelLinear(cfg.dim, cfg.ffn_dim, **col)
        self.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.dim, group=group, bias=cfg.mlp_bias,
                                           sequence_parallel=sequence_parallel, backend=lin, overlap=overlap)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """down(...) (+ residual: down_proj fuses the add where exact, see RowParallelLinear)."""
        gate, up = self.gate_proj, self.up_proj
        if gate.ring:  # one ring gathers x for both GEMMs (megaft.parallel.tensor.overlap)
            _, (g, u) = column_outputs(x, [gate, up])
            if self.activation == "gelu_pytorch_tanh":
                h = recompute.run(geglu, g, u, enabled=self.selective)
            else:
                h = recompute.run(swiglu, g, u, self.swiglu_backend, enabled=self.selective)
            return self.down_proj(h, residual)
        x = column_input(x, self.group, self.sp)
        if self.activation == "gelu_pytorch_tanh":  # HF GELUTanh: F.gelu(approximate="tanh")
            h = recompute.run(geglu, gate(x), up(x), enabled=self.selective)
        elif fused_gate_up(gate.backend, x.device) and gate.adapter is None and up.adapter is None:
            # one GEMM reads both weights, SwiGLU in its epilogue (LoRA adapters: the unfused path)
            h = fused_gate_up_swiglu(x, gate.weight, up.weight, gate.bias, up.bias)
        else:  # selective recompute: the activation runs again in backward, gate/up outputs are kept
            h = recompute.run(swiglu, gate(x), up(x), self.swiglu_backend, enabled=self.selective)
        return self.down_proj(h, residual)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up
