"""One mixture-of-experts block, forward + backward: megaft's MoE (megaft.models.moe) against
transformers' own block holding the same weights, and the all-to-all bytes expert
parallelism would move.

    python -m benchmarks.moe [--shape SPEC ...] [--device cpu|cuda] [--backends torch,...]
                             [--hf eager,grouped_mm] [--reps N] [--rounds R] [--warmup W]
                             [--ep 2 4 8] [--a2a-dtype fp32|bf16] [--profile] [--json PATH]

Shapes (--shape, repeatable): a preset name, optionally with overrides,
``olmoe:tokens=1024,dim=256``. Keys: tokens, dim, experts, ffn, top_k, norm (0/1).

    olmoe        2048 tokens, dim 512, 64 experts of ffn 256, top-8, no renormalization
                 (OLMoE-1B-7B's routing at a CPU-sized width; transformers' OlmoeSparseMoeBlock)
    mixtral      2048 tokens, dim 512, 8 experts of ffn 1024, top-2, renormalized
                 (Mixtral's routing; MixtralSparseMoeBlock)
    olmoe-full   8192 tokens, OLMoE-1B-7B's dims: dim 2048, 64 experts of ffn 1024, top-8
    mixtral-full 4096 tokens, Mixtral-8x7B's dims: dim 4096, 8 experts of ffn 14336, top-2

The default is olmoe and mixtral on CPU (the whole run takes about a minute on 2 cores),
olmoe-full and mixtral-full on CUDA. Everything runs in fp32 (the router of both runs in
fp32 anyway; in bf16 the two blocks' router logits round differently, which flips near-tied
top-k choices and makes an element-wise comparison meaningless).

What is timed: one forward and the backward of a fixed random output gradient, producing
the gradients of the input and of every weight (router included) through
torch.autograd.grad, as a training step needs them. Implementations:

- ``hf:eager``: transformers' loop over the experts hit (`experts_implementation="eager"`);
- ``hf:grouped_mm``: transformers' grouped GEMM path (torch's grouped_mm), what
  ``from_pretrained`` picks by default in transformers 5 where torch has the kernel;
- ``megaft:<backend>``: megaft's MoE with ``kernels.grouped_gemm=<backend>``, one row per
  backend of megaft.kernels.grouped_gemm that runs on the device (--backends to choose);
  on the CPU also ``megaft:torch._grouped_mm``: the cuda backend's function
  (megaft.kernels.grouped_gemm.cuda, torch._grouped_mm), which the dispatch keeps to CUDA
  tensors, called directly, i.e. the grouped GEMM transformers' grouped_mm path runs.

Every implementation is first checked against ``hf:eager`` on the same input and output
gradient: the output and every gradient (input, router, gate, up, down; transformers'
fused gate_up_proj gradient split in two) within a relative max-abs difference of 1e-5 of
the reference's largest value (fp32 rounding of a different summation order is ~1e-7).
An implementation that disagrees, or raises, is not timed: its row says why, and the run
exits with status 1 when a megaft one disagreed.

Timing: --reps timed calls per implementation in --rounds rounds whose order reverses
every other round (ABBA, benchmarks.train_step.measure.round_orders), each turn after
--warmup untimed calls; median with p20 / p80 and the fastest call (benchmarks.kernels.harness:
wall clock on CPU, CUDA events on a GPU). The ratio columns are an implementation's median
over a transformers implementation's (below 1: faster than transformers). GFLOP/s is the
block's matmul work (18 x tokens x top_k x dim x ffn, plus the router's) over the median,
and the floor line prices that work at a square fp32 matmul measured in the same run: an
implementation doing these matmuls gets below it only where its GEMMs beat a square one's. The load average is printed
at the start and the end: on a shared CPU other processes skew the times.

All-to-all bytes per rank under expert parallelism (ep ranks, the experts split in
contiguous blocks of E / ep, as Megatron and torchtitan place them), with the measured
batch as one rank's micro-batch: each of its tokens' top_k rows leaves the rank when its
expert lives on another rank (dispatch) and comes back (combine), so

    formula (uniform routing) = 2 x tokens x top_k x (ep - 1) / ep x dim x bytes per element
                                (megaft.perf.counts.a2a_bytes, what megaft-plan's ep_comm prices)
    exact (the measured routing, batch on rank r) = 2 x (rows whose expert is not in r's block) x dim x bytes

The exact count depends on which rank holds the batch; the table gives its min and max
over r (their mean is the formula exactly: each row's expert is in exactly one block). A
token whose top-k holds two experts of the same remote rank counts twice, as a row
dispatcher without de-duplication sends it.

A whole MoE decoder's training step with LoRA on the experts against its full fine-tune
(step time, state bytes against megaft.perf.memory): the companion `python -m benchmarks.moe_lora`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from benchmarks.kernels.harness import load_average, quantile, time_calls
from benchmarks.train_step.measure import round_orders, split_steps
from megaft.perf.counts import a2a_bytes

TOL = 1e-5  # relative (to the reference's largest |value|) max-abs difference allowed, fp32
HF_IMPLS = ("eager", "grouped_mm", "batched_mm")
GRAD_NAMES = ("dx", "d_router", "d_gate", "d_up", "d_down")


@dataclass(frozen=True)
class Shape:
    name: str
    family: str  # olmoe | mixtral: the transformers block compared against
    tokens: int
    dim: int
    experts: int
    ffn: int
    top_k: int
    norm: bool  # norm_topk_prob

    def describe(self) -> str:
        return (f"{self.name}: {self.tokens} tokens, dim {self.dim}, {self.experts} experts of ffn {self.ffn}, "
                f"top-{self.top_k}, norm_topk_prob {str(self.norm).lower()} (transformers {self.family})")


PRESETS = {
    "olmoe": Shape("olmoe", "olmoe", 2048, 512, 64, 256, 8, False),
    "mixtral": Shape("mixtral", "mixtral", 2048, 512, 8, 1024, 2, True),
    "olmoe-full": Shape("olmoe-full", "olmoe", 8192, 2048, 64, 1024, 8, False),
    "mixtral-full": Shape("mixtral-full", "mixtral", 4096, 4096, 8, 14336, 2, True),
}
_KEYS = {"tokens": "tokens", "dim": "dim", "experts": "experts", "ffn": "ffn", "top_k": "top_k", "k": "top_k",
         "norm": "norm"}


def parse_shape(spec: str) -> Shape:
    """``preset[:key=value,...]`` -> Shape (keys: tokens, dim, experts, ffn, top_k, norm)."""
    name, _, rest = spec.partition(":")
    if name not in PRESETS:
        raise SystemExit(f"--shape {spec!r}: unknown preset {name!r}; one of {', '.join(PRESETS)}")
    shape = PRESETS[name]
    changes = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in _KEYS or not value:
            raise SystemExit(f"--shape {spec!r}: {item!r} is not key=value with a key of {', '.join(_KEYS)}")
        field = _KEYS[key]
        changes[field] = value.lower() in ("1", "true", "yes") if field == "norm" else int(value)
    if changes:
        shape = dataclasses.replace(shape, name=spec, **changes)
    if shape.family == "mixtral" and not shape.norm:
        raise SystemExit(f"--shape {spec!r}: Mixtral always renormalizes its top-k weights (norm=1)")
    if not 1 <= shape.top_k <= shape.experts:
        raise SystemExit(f"--shape {spec!r}: top_k={shape.top_k} must be in 1..experts={shape.experts}")
    return shape


def gemm_flops(shape: Shape) -> int:
    """FLOPs of the block's matmuls, forward + backward: each of the 3 expert projections is
    2 x rows x dim x ffn forward and twice that backward (dx, dW) over rows = tokens x top_k;
    the router's [tokens, dim] x [dim, experts] likewise."""
    rows = shape.tokens * shape.top_k
    return 18 * rows * shape.dim * shape.ffn + 6 * shape.tokens * shape.dim * shape.experts


def matmul_rate(device: torch.device, reps: int = 20) -> float:
    """FLOP/s of the fastest of `reps` square fp32 matmuls (1024 on CPU, 8192 on CUDA), after
    as many warm-up ones: the GEMM ceiling of this run."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    return 2 * n ** 3 / min(time_calls([lambda: a @ b], device, reps, reps))


# ---------------------------------------------------------------- all-to-all bytes


# Bytes one rank sends and gets back (dispatch + combine) under uniform routing: the count
# megaft's cost model prices (megaft.perf.counts.a2a_bytes, the time model's ep_comm).
a2a_formula_bytes = a2a_bytes


def remote_rows(experts: torch.Tensor, n_experts: int, ep: int, rank: int) -> int:
    """Rows of the routing `experts` ([tokens, top_k] expert ids) whose expert is not on
    `rank`, with the experts split in contiguous blocks of n_experts / ep over the ep ranks."""
    if n_experts % ep:
        raise ValueError(f"{n_experts} experts do not split evenly over ep={ep}")
    owner = experts // (n_experts // ep)
    return int((owner != rank).sum())


def a2a_exact_bytes(experts: torch.Tensor, n_experts: int, ep: int, dim: int, elem_bytes: int) -> list[int]:
    """Per rank r that could hold the batch: the bytes it sends and gets back for `experts`."""
    return [2 * remote_rows(experts, n_experts, ep, r) * dim * elem_bytes for r in range(ep)]


def a2a_table(experts: torch.Tensor, shape: Shape, eps: Sequence[int], elem_bytes: int) -> list[dict]:
    rows = []
    for ep in eps:
        row = {"ep": ep, "formula_bytes": a2a_formula_bytes(shape.tokens, shape.top_k, shape.dim, elem_bytes, ep)}
        if shape.experts % ep:
            row["skipped"] = f"{shape.experts} experts do not split over ep={ep}"
        else:
            exact = a2a_exact_bytes(experts, shape.experts, ep, shape.dim, elem_bytes)
            row.update(exact_bytes=exact, exact_min=min(exact), exact_max=max(exact))
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the two layers


GROUPED_MM_CPU = "torch._grouped_mm"  # CPU only: the cuda backend's function, past the dispatch's refusal


def grouped_gemm_backends(device: torch.device) -> tuple[list[str], list[str]]:
    """(megaft grouped_gemm backends that run on `device`, 'backend: why not' for the others).
    On the CPU also GROUPED_MM_CPU: megaft.kernels.grouped_gemm.cuda.grouped_mm (torch._grouped_mm),
    which the dispatch keeps to CUDA tensors, called directly."""
    try:
        from megaft.kernels.grouped_gemm import cuda as grouped_cuda
    except ImportError as e:
        return ["torch"], [f"megaft.kernels.grouped_gemm does not import ({e}): MoE's own loop runs as torch"]
    from megaft.kernels import dispatch

    ok, skipped = [], []
    for name in dispatch.BACKENDS:
        if name == "auto":
            continue
        if name == "triton" and device.type == "cpu":
            why = "Triton on CPU is interpreted (not a performance number)"
        else:
            why = dispatch.unavailable_reason("grouped_gemm", name, device)
        (ok if why is None else skipped).append(name if why is None else f"{name}: {why}")
    if device.type == "cpu":
        if hasattr(torch, "_grouped_mm") and hasattr(grouped_cuda, "grouped_mm"):
            ok.append(GROUPED_MM_CPU)
        else:
            skipped.append(f"{GROUPED_MM_CPU}: torch {torch.__version__} has no torch._grouped_mm")
    return ok, skipped


@contextlib.contextmanager
def _grouped_mm_on_cpu():
    """megaft's grouped_mm front replaced by the cuda backend's function (torch._grouped_mm),
    which the dispatch refuses on CPU tensors; MoE imports the front at call time (or, once
    the import is module-level, reads megaft.models.moe.layer.grouped_mm: patched too)."""
    import megaft.kernels.grouped_gemm as front
    import megaft.models.moe.layer as moe_module
    from megaft.kernels.grouped_gemm import cuda as grouped_cuda

    def direct(x, w, counts, backend="auto"):
        return grouped_cuda.grouped_mm(x, w, counts)

    saved = [(m, getattr(m, "grouped_mm")) for m in (front, moe_module) if hasattr(m, "grouped_mm")]
    try:
        for m, _ in saved:
            m.grouped_mm = direct
        yield
    finally:
        for m, fn in saved:
            m.grouped_mm = fn


def _kernels(backend: str):
    from megaft.config.kernels import KernelsConfig

    kernels = KernelsConfig(backend="torch")
    backend = "torch" if backend == GROUPED_MM_CPU else backend
    if any(f.name == "grouped_gemm" for f in dataclasses.fields(KernelsConfig)):
        kernels.grouped_gemm = backend
    elif backend != "torch":
        raise RuntimeError("KernelsConfig has no grouped_gemm field yet")
    return kernels


def megaft_layer(shape: Shape, backend: str, device: torch.device, seed: int = 0):
    """megaft's MoE with seeded weights (router and experts N(0, 0.02))."""
    from megaft.config.model import ModelConfig
    from megaft.models.moe.layer import MoE
    from megaft.models.moe.router import RouterLog

    cfg = ModelConfig(dim=shape.dim, n_experts=shape.experts, top_k=shape.top_k, moe_ffn_dim=shape.ffn,
                      norm_topk_prob=shape.norm, arch=shape.family)
    layer = MoE(cfg, group=None, sequence_parallel=False, log=RouterLog(), kernels=_kernels(backend))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (layer.gate.weight, layer.experts.gate_proj, layer.experts.up_proj, layer.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return layer.to(device)


def megaft_params(layer) -> list[torch.nn.Parameter]:
    return [layer.gate.weight, layer.experts.gate_proj, layer.experts.up_proj, layer.experts.down_proj]


def hf_layer(shape: Shape, impl: str, source, device: torch.device):
    """transformers' block of `shape.family` with `experts_implementation=impl`, holding
    megaft layer `source`'s weights (gate_up_proj = [gate_proj; up_proj] along F)."""
    if shape.family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = MixtralConfig(hidden_size=shape.dim, intermediate_size=shape.ffn, num_local_experts=shape.experts,
                               num_experts_per_tok=shape.top_k, router_jitter_noise=0.0)
    else:
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block

        config = OlmoeConfig(hidden_size=shape.dim, intermediate_size=shape.ffn, num_experts=shape.experts,
                             num_experts_per_tok=shape.top_k, norm_topk_prob=shape.norm)
    config._experts_implementation = impl
    block = Block(config)
    with torch.no_grad():
        block.gate.weight.copy_(source.gate.weight)
        block.experts.gate_up_proj.copy_(torch.cat([source.experts.gate_proj, source.experts.up_proj], dim=1))
        block.experts.down_proj.copy_(source.experts.down_proj)
    return block.to(device)


def hf_params(block) -> list[torch.nn.Parameter]:
    return [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]


@dataclass
class Impl:
    name: str
    layer: torch.nn.Module
    params: list[torch.nn.Parameter]
    fused_gate_up: bool  # transformers: one gate_up_proj gradient, split for the comparison
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # around each call


def megaft_impl(layer, backend: str) -> Impl:
    context = _grouped_mm_on_cpu if backend == GROUPED_MM_CPU else contextlib.nullcontext
    return Impl(f"megaft:{backend}", layer, megaft_params(layer), False, context)


def fwd_bwd(impl: Impl, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients (input, router, gate, up, down) of one forward + backward."""
    with impl.context():
        y = impl.layer(x)
        grads = list(torch.autograd.grad(y, [x, *impl.params], dy))
    if impl.fused_gate_up:
        gate, up = grads[2].chunk(2, dim=1)
        grads = grads[:2] + [gate, up] + grads[3:]
    return y, grads


def compare(got, want) -> dict:
    """Max |got - want| of the output and each gradient, and whether each is within TOL."""
    (y, grads), (y_ref, grads_ref) = got, want
    diffs, ok = {}, True
    for name, g, w in zip(("out",) + GRAD_NAMES, [y, *grads], [y_ref, *grads_ref]):
        diff = (g.float() - w.float()).abs().max().item()
        scale = w.float().abs().max().item()
        diffs[name] = {"max_abs_diff": diff, "ref_max_abs": scale}
        ok = ok and diff <= TOL * max(scale, 1e-30)
    return {"diffs": diffs, "ok": ok}


# ---------------------------------------------------------------- one shape


def bench_shape(shape: Shape, *, device: torch.device, backends: Sequence[str], hf_impls: Sequence[str],
                reps: int, rounds: int, warmup: int, eps: Sequence[int], a2a_elem_bytes: int,
                rate: Optional[float] = None, seed: int = 0, out=sys.stdout) -> dict:
    """Check every implementation against hf:eager, time the ones that agree, count the
    all-to-all bytes; `rate`: the measured matmul FLOP/s the GEMM floor is priced at."""
    mine = [megaft_impl(megaft_layer(shape, backend, device, seed), backend) for backend in backends]
    source = mine[0].layer if mine else megaft_layer(shape, "torch", device, seed)  # the weights transformers copies
    impls: list[Impl] = [Impl("hf:eager", hf_layer(shape, "eager", source, device), [], True)]
    for impl in hf_impls:
        if impl != "eager":
            impls.append(Impl(f"hf:{impl}", hf_layer(shape, impl, source, device), [], True))
    impls += mine
    for impl in impls:
        if not impl.params:
            impl.params = hf_params(impl.layer)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, shape.tokens, shape.dim, generator=gen).to(device).requires_grad_()
    dy = torch.randn(1, shape.tokens, shape.dim, generator=gen).to(device)

    print(f"\n{shape.describe()}", file=out)
    result = {"shape": dataclasses.asdict(shape), "checks": {}, "timings": {}, "skipped": {}}
    ref = fwd_bwd(impls[0], x, dy)
    ready = [impls[0]]
    for impl in impls[1:]:
        try:
            check = compare(fwd_bwd(impl, x, dy), ref)
        except Exception as e:  # noqa: BLE001 - an implementation that raises is reported, not fatal
            result["skipped"][impl.name] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        result["checks"][impl.name] = check
        if check["ok"]:
            ready.append(impl)
        else:
            result["skipped"][impl.name] = "disagrees with hf:eager (see the check): not timed"
    _print_checks(result, out)

    with torch.no_grad():
        experts = source.gate(x)[3].reshape(shape.tokens, shape.top_k).cpu()
    result["a2a"] = a2a_table(experts, shape, eps, a2a_elem_bytes)
    result["a2a_elem_bytes"] = a2a_elem_bytes

    names = [i.name for i in ready]
    times: dict[str, list[float]] = {n: [] for n in names}
    by_name = {i.name: i for i in ready}
    for order, n in zip(round_orders(names, rounds), split_steps(reps, rounds)):
        for name in order:
            impl = by_name[name]
            times[name] += time_calls([lambda impl=impl: fwd_bwd(impl, x, dy)], device, warmup, n)
    for name in names:
        ts = times[name]
        result["timings"][name] = {"median_ms": 1e3 * statistics.median(ts), "p20_ms": 1e3 * quantile(ts, 0.2),
                                   "p80_ms": 1e3 * quantile(ts, 0.8), "min_ms": 1e3 * min(ts), "calls": len(ts)}
    t = result["timings"]
    result["gemm_flops"] = gemm_flops(shape)
    for v in t.values():
        v["gflops"] = result["gemm_flops"] / v["median_ms"] / 1e6
    if rate:
        result["matmul_gflops"] = rate / 1e9
        result["gemm_floor_ms"] = 1e3 * result["gemm_flops"] / rate
    result["ratios"] = {n: {r: t[n]["median_ms"] / t[r]["median_ms"] for r in t if r.startswith("hf:")} for n in t}
    _print_timings(result, reps, rounds, warmup, out)
    _print_a2a(result, shape, out)
    return result


def _g(v: float) -> str:
    return f"{v:.2e}"


def _print_checks(result: dict, out) -> None:
    print(f"check against hf:eager, max |diff| of the output and each gradient (max |ref| under it); "
          f"agree: <= {TOL:.0e} x max |ref|", file=out)
    header = ["impl", "out", *GRAD_NAMES, "agree"]
    rows = []
    for name, check in result["checks"].items():
        rows.append([name, *(_g(check["diffs"][k]["max_abs_diff"]) for k in ("out",) + GRAD_NAMES),
                     "yes" if check["ok"] else "NO"])
    if result["checks"]:
        first = next(iter(result["checks"].values()))
        rows.append(["(max |ref|)", *(_g(first["diffs"][k]["ref_max_abs"]) for k in ("out",) + GRAD_NAMES), ""])
    _table(header, rows, out)
    for name, why in result["skipped"].items():
        print(f"  {name}: {why}", file=out)


def _print_timings(result: dict, reps: int, rounds: int, warmup: int, out) -> None:
    t = result["timings"]
    refs = [n for n in t if n.startswith("hf:")]
    print(f"forward + backward, ms: median of {reps} calls in {rounds} alternating rounds ({warmup} warm-up "
          f"calls per turn), p20 / p80, min; ratio = median / transformers' median (target for megaft on CPU "
          f"fp32: <= 0.5 of hf)", file=out)
    header = ["impl", "median ms", "p20", "p80", "min", "GFLOP/s", *(f"/ {r}" for r in refs)]
    rows = [[name, f"{v['median_ms']:.1f}", f"{v['p20_ms']:.1f}", f"{v['p80_ms']:.1f}", f"{v['min_ms']:.1f}",
             f"{v['gflops']:.1f}", *(f"{v['median_ms'] / t[r]['median_ms']:.3f}" for r in refs)]
            for name, v in t.items()]
    _table(header, rows, out)
    floor = ""
    if "gemm_floor_ms" in result:
        floor = (f"; at this run's best fp32 matmul rate ({result['matmul_gflops']:.0f} GFLOP/s, square) they take "
                 f"{result['gemm_floor_ms']:.1f} ms (the floor at that rate)")
    print(f"  matmul work: {result['gemm_flops'] / 1e9:.2f} GFLOP (18 x tokens x top_k x dim x ffn + the router)"
          + floor, file=out)


def _print_a2a(result: dict, shape: Shape, out) -> None:
    eb = result["a2a_elem_bytes"]
    print(f"expert-parallel all-to-all per rank (dispatch + combine; rows of {shape.dim} x {eb} bytes): "
          f"formula (uniform routing) vs this batch's routing on rank r (min / max over r)", file=out)
    rows = []
    for r in result["a2a"]:
        if "skipped" in r:
            rows.append([str(r["ep"]), _bytes(r["formula_bytes"]), r["skipped"], "", ""])
        else:
            rows.append([str(r["ep"]), _bytes(r["formula_bytes"]), _bytes(r["exact_min"]), _bytes(r["exact_max"]),
                         f"{r['exact_max'] / r['formula_bytes']:.3f}"])
    _table(["ep", "formula", "exact min", "exact max", "max / formula"], rows, out)


def _bytes(n: float) -> str:
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


def _table(header: list[str], rows: list[list[str]], out) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)), file=out)
    for r in rows:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)), file=out)


def profile(shape: Shape, backend: str, device: torch.device, rows: int = 20, out=sys.stdout) -> None:
    """torch.profiler's table of one megaft forward + backward (after one untimed call)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    impl = megaft_impl(megaft_layer(shape, backend, device), backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape.tokens, shape.dim, generator=gen).to(device).requires_grad_()
    dy = torch.randn(1, shape.tokens, shape.dim, generator=gen).to(device)
    fwd_bwd(impl, x, dy)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        fwd_bwd(impl, x, dy)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\nprofile of megaft:{backend} on {shape.name}, one forward + backward", file=out)
    print(prof.key_averages().table(sort_by=key, row_limit=rows), file=out)


# ---------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None, out=sys.stdout) -> dict:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", default=None,
                   help="preset[:key=value,...], repeatable (default: olmoe, mixtral; -full ones on CUDA)")
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--backends", default=None,
                   help="megaft grouped_gemm backends, comma-separated (default: every one that runs on the device)")
    p.add_argument("--hf", default="eager,grouped_mm",
                   help=f"transformers experts implementations ({', '.join(HF_IMPLS)}); eager, the reference, "
                   "always runs")
    p.add_argument("--reps", type=int, default=None, help="timed calls per implementation (default: 6 CPU, 20 CUDA)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds the calls are split into (2 = ABBA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per turn (default: 0 CPU, 3 CUDA; the "
                   "correctness check already ran each implementation once)")
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8], help="expert-parallel degrees of the bytes table")
    p.add_argument("--a2a-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="element type the all-to-all would move (bf16 under bf16 training)")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's table of each megaft backend")
    p.add_argument("--json", default=None, help="write every number to this JSON file (e.g. benchmarks/results/...)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA device here")
    on_gpu = device.type == "cuda"
    shapes = [parse_shape(s) for s in (args.shape or (["olmoe-full", "mixtral-full"] if on_gpu else
                                                      ["olmoe", "mixtral"]))]
    reps = args.reps or (20 if on_gpu else 6)
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 0)
    hf_impls = [h for h in filter(None, args.hf.split(","))]
    unknown = [h for h in hf_impls if h not in HF_IMPLS]
    if unknown:
        raise SystemExit(f"--hf: unknown {unknown}; one of {', '.join(HF_IMPLS)}")
    available, skipped = grouped_gemm_backends(device)
    if args.backends:
        asked = args.backends.split(",")
        missing = [b for b in asked if b not in available]
        if missing:
            why = "; ".join(s for s in skipped if s.split(":")[0] in missing) or "unknown backend"
            raise SystemExit(f"--backends {missing} cannot run on {device.type}: {why}")
        available = asked
    a2a_bytes = {"fp32": 4, "bf16": 2}[args.a2a_dtype]
    where = torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
    print(f"MoE block forward + backward, fp32 on {where}, {torch.get_num_threads()} threads "
          f"(load average {load_average()} at the start); torch "
          f"{torch.__version__}, transformers {_version('transformers')}; megaft grouped_gemm backends: "
          f"{', '.join(available)}", file=out)
    for s in skipped:
        print(f"  skipped backend {s}", file=out)
    rate = matmul_rate(device)
    results = []
    for shape in shapes:
        results.append(bench_shape(shape, device=device, backends=available, hf_impls=hf_impls, reps=reps,
                                   rounds=args.rounds, warmup=warmup, eps=args.ep, a2a_elem_bytes=a2a_bytes,
                                   rate=rate, seed=args.seed, out=out))
        if args.profile:
            for backend in available:
                profile(shape, backend, device, out=out)
    print(f"\nload average {load_average()} at the end (other processes on the machine skew CPU timings)", file=out)
    report = {"environment": {"device": where, "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "load_average_end": load_average(),
                              "transformers": _version("transformers"), "python": platform.python_version(),
                              "command": " ".join(["python -m benchmarks.moe", *(argv if argv is not None
                                                                                   else sys.argv[1:])])},
              "backends_skipped": skipped, "shapes": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = [name for r in results for name, c in r["checks"].items() if name.startswith("megaft:") and not c["ok"]]
    if bad:
        raise SystemExit(f"megaft disagrees with transformers ({', '.join(sorted(set(bad)))}): not timed")
    return report


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


if __name__ == "__main__":
    main()
