"""What optim.name=muon adds to a step (megaft.optim.muon, muon_zero), for megaft.perf.time.

Muon orthogonalises each hidden 2-D weight's update with `ns_steps` quintic Newton-Schulz
iterations in bf16 on the whole matrix, in its wide orientation X [m, n] (m <= n):
A = X X^T (2 m^2 n FLOPs), B = b A + c A A (2 m^3), X <- a X + B X (2 m^2 n), so
ns_steps * (4 m^2 n + 2 m^3) FLOPs a matrix (`ns_flops`; tests/test_muon_cost.py counts the
implementation's with torch's FlopCounterMode). Where that runs:

- tp > 1: every tp rank gathers the whole update of its shards over tp and orthogonalises the
  whole matrix (the work does not shrink with tp; the gather is one all-gather of the matrix);
- ZeRO >= 1: one extra all-gather of the Muon buckets over dp (the momentum updates, the size of
  the params' gather), and each rank orthogonalises only the matrices its chunk holds (about
  1/dp of them);
- optimizer state: one fp32 momentum buffer a Muon element (4 bytes, not AdamW's 8; with
  optim.master_weights 4 + 4 beside the fp32 master, bf16 params and grads: 2 + 2 + 8), the
  AdamW tensors AdamW's (megaft.perf.memory, `rank_muon_elements`; the gathered updates are
  transient fp32);
- parallel.offload=cpu: the momentum (and masters) live on the host with AdamW's state, and
  Newton-Schulz still runs on the device: each owned Muon element's update goes up (fp32, 4
  bytes) and its orthogonalised value comes back (bf16, 2 bytes), in the link's two directions
  beside the grads going down and the masters up; the up direction carries the 4 more bytes
  (`muon_offload_bytes`).
"""
from __future__ import annotations

from megaft.config.model import ModelConfig, kv_replicas
from megaft.perf.counts import _mla_params, adapter_layer_params, expert_adapter_params, expert_params, per_block


def _mlp(ffn: int, dim: int) -> list[tuple[int, int]]:
    return [(ffn, dim), (ffn, dim), (dim, ffn)]


# the dense linears LoRA can target, column-parallel (True) or row-parallel (False)
_COLUMN = {"q": True, "k": True, "v": True, "o": False, "gate": True, "up": True, "down": False}


def _dense(m: ModelConfig) -> dict[str, tuple[int, int]]:
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
    return {"q": (q, m.dim), "k": (kv, m.dim), "v": (kv, m.dim), "o": (m.dim, q), "gate": (m.ffn_dim, m.dim),
            "up": (m.ffn_dim, m.dim), "down": (m.dim, m.ffn_dim)}


def _pairs(shapes: dict[str, tuple[int, int]], targets, r: int) -> list[tuple[int, int, bool]]:
    """(rows, cols, split over tp) of the adapters B [out, r] and A [r, in] of each targeted linear in
    `shapes`; a column linear's B and a row linear's A are the tp-split halves."""
    out = []
    for name, (rows, cols) in shapes.items():
        if name in targets:
            out += [(rows, r, _COLUMN[name]), (r, cols, not _COLUMN[name])]
    return out


def _adapters(m: ModelConfig, lora, layer: int = 0, ep: int = 1) -> list[tuple[int, int, bool]]:
    """The Muon adapter matrices of block `layer` on an ep rank (`_pairs`): the attention's, the dense
    MLP's, or on a mixture of experts each of its n_experts/ep routed experts' (target `experts`: one
    matrix per expert of the [E, ...] stacks) and the shared expert's (target `shared_expert`); the
    router's adapter stays on AdamW, as the router."""
    d, r = _dense(m), lora.rank
    out = _pairs({k: d[k] for k in ("q", "k", "v", "o")}, lora.targets, r)
    if not m.is_moe(layer):
        return out + _pairs({k: d[k] for k in ("gate", "up", "down")}, lora.targets, r)
    mlp = dict(zip(("gate", "up", "down"), _mlp(m.expert_ffn, m.dim)))
    if "experts" in lora.targets:
        out += _pairs(mlp, mlp, r) * (m.n_experts // ep)
    if "shared_expert" in lora.targets and m.shared_expert_ffn_dim:
        shared = dict(zip(("gate", "up", "down"), _mlp(m.shared_expert_ffn_dim, m.dim)))
        out += _pairs(shared, shared, r)
    return out


def hidden_matrices(m: ModelConfig, layer: int = 0, ep: int = 1, lora=None) -> list[tuple[int, int]]:
    """The whole (rows, cols) of block `layer`'s Muon matrices on an ep rank: q, k, v, o, and gate,
    up, down of the dense MLP, or of each of its n_experts/ep routed experts and the shared expert
    (the router and the shared expert's gate stay on AdamW). Under LoRA (`lora.rank` > 0) only the
    adapters train: their A and B (`_adapters`)."""
    if lora is not None and lora.rank:
        return [(rows, cols) for rows, cols, _ in _adapters(m, lora, layer, ep)]
    dense = _dense(m)
    out = [dense[k] for k in ("q", "k", "v", "o")]
    if not m.is_moe(layer):
        return out + [dense[k] for k in ("gate", "up", "down")]
    out += _mlp(m.expert_ffn, m.dim) * (m.n_experts // ep)
    return out + (_mlp(m.shared_expert_ffn_dim, m.dim) if m.shared_expert_ffn_dim else [])


def tp_gathered(m: ModelConfig, layer: int = 0, ep: int = 1, lora=None, tp: int = 1) -> list[tuple[int, int]]:
    """The Muon matrices split over tp as gathered before Newton-Schulz: every hidden matrix, k and v
    with each head's copies when tp > n_kv_heads (the gather brings tp/n_kv_heads copies of each head;
    Newton-Schulz then runs on each head once: `hidden_matrices`); under LoRA only the split halves (a
    column linear's B, a row linear's A; LoRA on k/v is refused at tp > n_kv_heads)."""
    if lora is not None and lora.rank:
        return [(rows, cols) for rows, cols, split in _adapters(m, lora, layer, ep) if split]
    out, copies = hidden_matrices(m, layer, ep), kv_replicas(m, tp)
    out[1:3] = [(rows * copies, cols) for rows, cols in out[1:3]]  # q, k, v, o, ...: k and v
    return out


def muon_offload_bytes(elements: int) -> int:
    """Bytes more on the busier PCIe direction (host to device) under offload for `elements` owned
    Muon elements: their fp32 updates (module docstring)."""
    return 4 * elements


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Newton-Schulz FLOPs of one (rows, cols) matrix (module docstring)."""
    small, large = min(rows, cols), max(rows, cols)
    return steps * (4.0 * small * small * large + 2.0 * small ** 3)


def block_ns_flops(m: ModelConfig, steps: int, layer: int = 0, ep: int = 1, lora=None) -> float:
    """Block `layer`'s Newton-Schulz FLOPs on an ep rank."""
    return sum(ns_flops(r, c, steps) for r, c in hidden_matrices(m, layer, ep, lora))


def block_matrix_elements(m: ModelConfig, layer: int = 0, ep: int = 1, lora=None) -> int:
    """Block `layer`'s Muon elements (whole matrices) on an ep rank."""
    return sum(r * c for r, c in hidden_matrices(m, layer, ep, lora))


def _block_local_elements(m: ModelConfig, layer: int, tp: int, ep: int, lora) -> tuple[int, int]:
    """(all, routed-expert) Muon elements of block `layer` on one tp and ep rank, as the rank holds
    them (tp shards; k/v with each copied head under tp > n_kv_heads; latent attention's replicated
    down projections whole)."""
    if lora is not None and lora.rank:  # the adapters, less the router's (AdamW)
        adapters = adapter_layer_params(m, lora, tp, layer, ep)[0]
        if m.is_moe(layer) and "router" in lora.targets:
            adapters -= lora.rank * (m.dim + m.n_experts)
        return adapters, expert_adapter_params(m, lora, tp, layer, ep)
    if m.mla:
        replicated, split = _mla_params(m)
        attention = replicated + split // tp
    else:
        q, kv = m.n_heads * m.hd, m.kv_heads * kv_replicas(m, tp) * m.hd
        attention = (m.dim * (q + 2 * kv) + q * m.dim) // tp
    if not m.is_moe(layer):
        return attention + 3 * m.dim * m.ffn_dim // tp, 0
    routed = expert_params(m, layer, tp, ep)
    return attention + routed + 3 * m.dim * (m.shared_expert_ffn_dim or 0) // tp, routed


def rank_muon_elements(m: ModelConfig, layers, *, tp: int, ep: int, lora=None) -> tuple[int, int]:
    """(dense, routed-expert) Muon elements one tp and ep rank holds on blocks `layers`: the elements
    whose optimizer state is the momentum alone (module docstring). The routed experts' part is apart
    only at ep > 1, where it shards over the expert replicas (megaft.perf.memory's split); else 0."""
    blocks = per_block(m, lambda i: _block_local_elements(m, i, tp, ep, lora))
    total, routed = sum(blocks[i][0] for i in layers), sum(blocks[i][1] for i in layers)
    return (total - routed, routed) if ep > 1 else (total, 0)
