"""What a step spends outside the GEMMs and the attention core: elementwise, norm and loss kernels,
kernel launches and, in eager PyTorch, the host's dispatch (issue 42).

A memory-bound kernel takes the bytes it reads and writes over the HBM bandwidth a well-written one
reaches (`cluster.hbm_tbps × cluster.hbm_fraction`); every kernel, GEMMs included, leaves the GPU
idle for `cluster.kernel_gap_us` between it and the next (the launch). Bytes are counted per element
of the tensor each op touches, from the op's definition, for two implementations:

* compiled (`cluster.compiled: true`): one fused kernel per op, as Megatron's fused kernels (apex
  RMSNorm/LayerNorm, fused rotary, bias-SwiGLU/GeLU, bias-dropout-add) or a torch.compile'd block
  run them: a norm reads x and writes y;
* eager (`cluster.compiled: false`): PyTorch's own decomposition, as torchtitan's Llama runs without
  torch.compile: RMSNorm in fp32 (x.float(), pow, mean, x * rsqrt, .type_as(x), * weight), rotary
  through fp32 complex numbers (x.float(), complex multiply, .type_as(x)), silu then multiply. Each
  eager op is also dispatched by the host (`cluster.eager_op_us`); the GPU queue runs ahead of the
  host, so the host shows only where a block's host time exceeds its GPU time (a block then takes
  its host time).

The loss is priced on the vocab-parallel logits (tokens × vocab/tp): compiled, Megatron's
vocab-parallel cross-entropy (fp32 copy, max, subtract, exp, sum, divide in place; backward scales
the kept softmax and casts it back); eager, torch's cross_entropy on `logits.float()` (torchtitan).

Not priced: dropout (megaft's default is 0), the MoE token permutations, qk-norm, the embedding's
gradient scatter, biases; the optimizer step is priced in megaft.perf.time (ADAM_BYTES).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

FP32 = 4

# bytes per element (a: the activation dtype's bytes) and kernels, per pass (forward, backward)
# compiled: one fused kernel per op
#   norm: read x, write y | read x and dy, write dx
#   residual add: read two, write one | the gradient's accumulation into the residual stream: the same
#   rotary (q and k, one kernel each): read, write | the same
#   gated activation: read gate and up, write h | read gate, up and dh, write dgate and dup


def _compiled(a: int) -> dict:
    return {"norm": ((2 * a, 1), (3 * a, 1)), "residual": ((3 * a, 1), (3 * a, 1)),
            "rotary": ((2 * a, 2), (2 * a, 2)), "act": ((3 * a, 1), (5 * a, 1))}


# eager PyTorch:
#   norm forward: x.float() (a + 4), pow (4 + 4), mean (4), x * rsqrt (4 + 4), .type_as (4 + a),
#   * weight (a + a): 6 kernels; backward: each op's gradient, about twice the forward's bytes
#   rotary, q and k each: .float() (a + 4), complex multiply (4 + 4), .type_as (4 + a): 3 kernels
#   activation forward: silu (a + a), multiply (3a); backward: the product's two grads (5a), silu's (3a)
def _eager(a: int) -> dict:
    norm = 4 * a + 7 * FP32
    return {"norm": ((norm, 6), (2 * norm, 12)), "residual": ((3 * a, 1), (3 * a, 1)),
            "rotary": ((2 * a + 4 * FP32, 6), (2 * a + 4 * FP32, 6)), "act": ((5 * a, 2), (8 * a, 4))}


# the loss, per logit: compiled (Megatron's vocab-parallel CE): forward .float() (a + 4), max (4),
# subtract (8), exp (8), sum (4), divide (8): 6 kernels; backward mul_ by the grad (8), cast (4 + a): 2
# eager (torch's cross_entropy on logits.float()): forward .float() (a + 4), log_softmax (read twice,
# write once: 12); backward nll's one-hot (4), log_softmax's (12), the cast (4 + a): 3 kernels each way
def _loss(a: int, compiled: bool) -> tuple:
    if compiled:
        return (a + 9 * FP32, 6), (3 * FP32 + a, 2)
    return (a + 4 * FP32, 3), (5 * FP32 + a, 3)


GEMM_KERNELS = (5, 9)  # per block: four linears and the attention core; backward: two GEMMs per linear, one core


@dataclass(frozen=True)
class KernelCosts:
    """A device's memory-bound kernel rate and launch gap, and the framework's mode."""

    bandwidth: float  # bytes/s a memory-bound kernel reaches
    gap: float  # seconds of GPU idle per kernel launch
    compiled: bool  # fused kernels; False = eager PyTorch
    op_host: float  # seconds of host dispatch per eager op

    @classmethod
    def of(cls, cluster, hbm_tbps: float) -> Optional["KernelCosts"]:
        """The costs of a cluster preset (megaft.config.cluster.ClusterConfig), or None when it prices
        no elementwise kernel (hbm_fraction = 0: the model before issue 42's second slice)."""
        if cluster.hbm_fraction <= 0 or hbm_tbps <= 0:
            return None
        return cls(hbm_tbps * 1e12 * cluster.hbm_fraction, cluster.kernel_gap_us * 1e-6, cluster.compiled,
                   0.0 if cluster.compiled else cluster.eager_op_us * 1e-6)


class Pass(NamedTuple):
    """One pass (forward or backward) of a block's kernels outside the GEMMs and the core."""

    nbytes: float  # bytes the elementwise kernels read and write
    kernels: int  # kernels launched, GEMMs and the attention core included
    act_bytes: float  # of nbytes, the gated activation's (what model.recompute=selective runs again)


def block_passes(m, layer: int, tokens: int, tp: int, sp: bool, a: int, compiled: bool) -> tuple[Pass, Pass]:
    """(forward, backward) of block `layer` of `m` (megaft.config.model.ModelConfig) on one tp rank for
    its `tokens`: two norms and two residual adds over the residual stream (tokens/tp rows under
    sequence parallelism, all of them otherwise), rotary over this rank's q and k heads, the gated
    activation over its ffn/tp columns (a mixture of experts: top_k routed copies and the shared
    expert). `a`: bytes per activation element."""
    table = _compiled(a) if compiled else _eager(a)
    rows = tokens // tp if sp else tokens
    qk = (m.n_heads * m.qk_head_dim * 2 if m.mla else (m.n_heads + m.kv_heads) * m.hd) // tp
    width = (m.top_k * m.expert_ffn + m.shared_expert_ffn_dim if m.is_moe(layer) else m.ffn_dim) // tp
    sizes = {"norm": 2 * rows * m.dim, "residual": 2 * rows * m.dim, "rotary": tokens * qk, "act": tokens * width}
    counts = {"norm": 2, "residual": 2, "rotary": 1, "act": 1}
    out = []
    for p in (0, 1):
        nbytes = sum(table[op][p][0] * n for op, n in sizes.items())
        kernels = GEMM_KERNELS[p] + sum(table[op][p][1] * counts[op] for op in sizes)
        out.append(Pass(float(nbytes), kernels, float(table["act"][p][0] * sizes["act"])))
    return out[0], out[1]


def loss_passes(m, tokens: int, tp: int, a: int, compiled: bool) -> tuple[Pass, Pass]:
    """(forward, backward) of the cross-entropy over this rank's vocab-parallel logits."""
    logits = tokens * -(-m.vocab_size // tp)
    return tuple(Pass(float(per * logits), kernels, 0.0) for per, kernels in _loss(a, compiled))


def pass_s(p: Pass, kc: KernelCosts) -> float:
    """GPU seconds of a pass's memory-bound kernels and every kernel's launch gap."""
    return p.nbytes / kc.bandwidth + p.kernels * kc.gap


def host_s(p: Pass, kc: KernelCosts) -> float:
    """Host seconds to dispatch a pass's ops in eager mode (0 compiled)."""
    return p.kernels * kc.op_host


def with_host(gpu_s: float, p: Pass, kc: KernelCosts) -> float:
    """A pass's seconds when the GPU takes `gpu_s` for it: the host's dispatch shows only where it is
    slower than the GPU (the launch queue runs ahead otherwise)."""
    return max(gpu_s, host_s(p, kc))


def add_block_kernels(layer_f: float, layer_b: float, again_f: float, passes: tuple[Pass, Pass],
                      kc: KernelCosts) -> tuple[float, float, float]:
    """A block's (forward, backward, selective recompute) seconds with its `passes` (block_passes)
    added: their GPU time on top of the GEMMs and the core, then the eager host's bound; the
    selective recompute runs the activation's forward again."""
    f, b = passes
    return (with_host(layer_f + pass_s(f, kc), f, kc), with_host(layer_b + pass_s(b, kc), b, kc),
            again_f + f.act_bytes / kc.bandwidth)
