"""ColumnParallelLinear and RowParallelLinear (Megatron's names and semantics).

Weights are [out, in] like nn.Linear. Column splits `out` over tp ranks; Row splits
`in` and expects its input already split. With sequence parallel the activations
outside these layers are split along the sequence (dim 1 of [batch, seq, hidden]).

`backend` is `kernels.linear` (megaft.kernels.linear.layer_linear): "torch" is F.linear;
"triton" and "cuda" fuse the bias (and, in RowParallelLinear at tp=1, the residual add)
into the GEMM (a Triton GEMM epilogue, or one cuBLASLt matmul) and accumulate the weight
gradient straight into the fp32 `weight.grad`.

`adapter` (None, or a module set by megaft.peft.apply_lora): called on the layer's local
input, its output is added to the local GEMM's before any reduction (a row-parallel
adapter's partial product is summed by the layer's own all-reduce / reduce-scatter).

`overlap` (`parallel.tp_overlap=ring`, with sequence parallel at tp > 1): the sequence
all-gather and reduce-scatter run as rings of p2p steps beside chunked GEMMs
(megaft.parallel.tensor.overlap), on torch's GEMMs whatever `backend` says.
`column_outputs` runs the ring once for the layers sharing one input (q/k/v, gate/up).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from megaft.config.model import padded_size
from megaft.kernels.linear import EPILOGUE_BACKENDS, layer_linear, resolve_backend
from megaft.kernels.linear.main_grad import compute_dtype
from megaft.parallel.comm import Group, group_size
from megaft.parallel.tensor.comm import copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp
from megaft.parallel.tensor.overlap import ring_column, ring_row
from megaft.parallel.tensor.shard import mark_sequence_parallel, mark_sharded


def column_input(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Enter a column-parallel region: f (copy_to_tp) or, with sequence parallel, the
    sequence all-gather. Layers that share one input (q/k/v, gate/up) call it once
    and are built with `shared_input=True`, saving a collective per extra layer."""
    return gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)


def column_outputs(x: torch.Tensor, layers: Sequence["ColumnParallelLinear"],
                   weights: Optional[Sequence[Optional[tuple]]] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the column-parallel input, each layer's output) for `layers` sharing the input `x`
    (built with `shared_input=True`). `weights`: per layer None (its own weight, bias and
    adapter) or a (weight, bias) pair used in their place, with no adapter (the attention's
    replicated kv heads). With the ring overlap on, one ring gathers x and runs every GEMM
    chunk by chunk; else `column_input`, then each GEMM on the gathered input."""
    first = layers[0]
    own = weights or [None] * len(layers)
    pairs = [(layer.weight, layer.bias) if w is None else w for layer, w in zip(layers, own)]
    if first.ring:
        x, ys = ring_column(x, [w for w, _ in pairs], [b for _, b in pairs], first.group)
    else:
        x = column_input(x, first.group, first.sequence_parallel)
        ys = [layer_linear(x, w, b, backend=layer.backend) for layer, (w, b) in zip(layers, pairs)]
    return x, [layer.finish(x, y) if w is None else y for layer, w, y in zip(layers, own, ys)]


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along its output rows.

    Input: replicated (or a sequence shard with `sequence_parallel`, gathered here).
    Output: this rank's columns, or all of them with `gather_output`. `out_features`
    that tp does not divide is an error unless `pad_to` is given: then it is padded to a
    multiple of pad_to * tp; padded outputs are zero
    weights and the caller masks or drops them (see the vocabulary head).
    With `shared_input` the caller has already applied `column_input`.
    """

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False, pad_to: Optional[int] = None,
                 shared_input: bool = False, backend: str = "torch", overlap: bool = False):
        super().__init__()
        tp = group_size(group)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.ring = overlap and sequence_parallel and tp > 1  # parallel.tp_overlap=ring (column_outputs)
        self.shared_input, self.backend = shared_input, backend
        self.in_features, self.out_features = in_features, out_features
        padded = padded_size(out_features, (pad_to or 1) * tp)
        if padded != out_features and pad_to is None:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} not divisible by tp={tp}")
        self.weight = mark_sharded(nn.Parameter(torch.empty(padded // tp, in_features)), 0, out_features, padded)
        self.bias = None
        if bias:
            self.bias = mark_sharded(nn.Parameter(torch.zeros(padded // tp)), 0, out_features, padded)
        self.adapter: Optional[nn.Module] = None  # LoRA (megaft.peft): its output is added to y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shared_input:
            return column_outputs(x, [self])[1][0]
        return self.finish(x, layer_linear(x, self.weight, self.bias, backend=self.backend))

    def finish(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The rest of forward once the GEMM gave y: the adapter on the input x, the gather."""
        if self.adapter is not None:
            y = y + self.adapter(x)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along its input columns; x is already split.

    Partial products are summed with an all-reduce, or with sequence parallel a
    reduce-scatter along the sequence. The bias is added once, after the sum.
    `forward(x, residual)` returns `residual + y`: at tp=1 the add is the GEMM's
    epilogue on the fused backend; under tp it must follow the sum (each rank holds a
    partial y), so it stays a separate add there.
    """

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool = False,
                 sequence_parallel: bool = False, backend: str = "torch", overlap: bool = False):
        super().__init__()
        tp = group_size(group)
        self.ring = overlap and sequence_parallel and tp > 1  # parallel.tp_overlap=ring: ring_row
        if in_features % tp:
            raise ValueError(f"RowParallelLinear: in_features={in_features} not divisible by tp={tp}")
        self.group, self.sequence_parallel, self.backend = group, sequence_parallel, backend
        self.in_features, self.out_features = in_features, out_features
        weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.weight = mark_sharded(weight, 1, in_features, in_features)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        self.adapter: Optional[nn.Module] = None  # LoRA (megaft.peft): partial output added before the sum

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.ring:  # the partial product reduce-scattered chunk by chunk (the adapter's joins it)
            y = ring_row(x, self.weight, self.group, extra=None if self.adapter is None else self.adapter(x))
            y = y if self.bias is None else y + self.bias
            return y if residual is None else residual + y
        choice = resolve_backend(self.backend, x.device)
        if group_size(self.group) == 1 and choice in EPILOGUE_BACKENDS and self.adapter is None and (
                self.bias is None or self.bias.dtype == compute_dtype(x)):
            # no sum: bias and residual go into the epilogue (an fp32 bias under autocast
            # promotes y to fp32 in the unfused path, so that case stays unfused)
            return layer_linear(x, self.weight, self.bias, residual, backend=choice)
        y = layer_linear(x, self.weight, backend=choice)
        if self.adapter is not None:  # B replicated: sum over tp of B (A_i x_i) = B A x, in the same reduction
            y = y + self.adapter(x)
        y = reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y
