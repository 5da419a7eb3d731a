"""optim.muon.ns_backend (issue 41): Muon's Newton-Schulz iteration in Triton (megaft.kernels.newton_schulz:
A = X X^T and b A + c A A^T as symmetric GEMMs over the tiles on and above the diagonal, mirrored; the
axpy in the epilogue), run here under Triton's CPU interpreter, against torch.optim.Muon's own
`_zeropower_via_newtonschulz` (square, tall, wide and [E, rows, cols] expert stacks, ns_steps 1 and 5),
a Muon training run on it against the torch iteration's, and the backend's config refused with the fix.

The tolerance. Both paths run the iteration in bf16 and form each product the same way: exact
products of bf16 values summed in fp32, the axpy (alpha acc + beta Z) in fp32, one rounding to bf16
(the interpreter's truncating cast is replaced by round-to-nearest-even in the kernel, as a GPU's). What
differs is the order of the fp32 sums (the kernel's K tiles against torch's GEMM), a relative 2^-24 k
per entry before rounding: at most one bf16 rounding flips (one ulp, relative 2^-8), rarely. Such a
flip is carried by the remaining steps, whose quintic has slope |p'(s)| <= 1 near the fixed band
s ~ 0.7-1.2 where the singular values sit after the first steps: the result's entries differ by at most
a couple of ulp. Asserted: every entry within 2 ulp of bf16 at the result's largest entry, and the
Frobenius difference within 2^-9 of the reference's norm (measured on these shapes: 2-D ones bitwise,
stacks at most one ulp, 2.4e-4 relative).
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns  # noqa: E402

from megaft.config import Config  # noqa: E402
from megaft.config.model import ModelConfig  # noqa: E402
from megaft.config.optim import OptimConfig, check_optim  # noqa: E402
from megaft.kernels import _triton  # noqa: E402
from megaft.kernels.newton_schulz import newton_schulz, resolve_backend  # noqa: E402
from megaft.models.decoder import Decoder  # noqa: E402
from megaft.models.init import init_params  # noqa: E402
from megaft.optim.checks import check_fused  # noqa: E402
from megaft.optim.muon import MuonAdamW, flat_split, muon_split  # noqa: E402
from megaft.parallel.data import FlatParams  # noqa: E402

COEFFS = (3.4445, -4.7750, 2.0315)
# the Triton kernel on CPU tensors: interpreted (a machine with a GPU runs the compiled one, test_..._on_a_gpu)
interpreted = pytest.mark.skipif(not _triton.interpreting(), reason="Triton on CPU runs only under TRITON_INTERPRET=1")
SHAPES = {"square": (48, 48), "tall": (100, 40), "wide": (40, 100), "two_tiles": (130, 70),
          "experts_wide": (3, 40, 72), "experts_tall": (3, 72, 40)}


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at magnitude x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """torch.optim.Muon's iteration; a stack expert by expert."""
    if g.dim() == 3:
        return torch.stack([torch_ns(e, COEFFS, steps, 1e-7) for e in g])
    return torch_ns(g, COEFFS, steps, 1e-7)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The module docstring's tolerance."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 2 * bf16_ulp(want.abs().max().item())
    assert (got - want).norm() <= 2.0 ** -9 * want.norm()


@interpreted
@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_triton_equals_torch_muon(shape, steps):
    g = torch.randn(*SHAPES[shape], generator=torch.Generator().manual_seed(1))
    want = reference(g, steps)
    got = newton_schulz(g, *COEFFS, steps, 1e-7, backend="triton")
    assert got.dtype == torch.bfloat16
    assert_close(got, want)
    assert torch.equal(newton_schulz(g, *COEFFS, steps, 1e-7, backend="torch").float(), want.float())



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _triton.interpreting(),
                    reason="needs a CUDA GPU, Triton compiled (make gpu-check runs it)")
@pytest.mark.parametrize("shape", [*sorted(SHAPES), "down_proj_1b", "experts_1b"])
def test_triton_equals_torch_muon_on_a_gpu(shape, monkeypatch):
    """The compiled kernel (no interpreter: bf16 tl.dot, the GPU's round-to-nearest cast) against
    torch.optim.Muon's iteration on the GPU, with the CPU test's tolerance; cuBLAS's reduced-precision
    bf16 reductions are switched off so that the reference sums in fp32, as the derivation assumes."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    dims = {"down_proj_1b": (2048, 8192), "experts_1b": (8, 1024, 2048)}.get(shape) or SHAPES[shape]
    g = torch.randn(*dims, generator=torch.Generator().manual_seed(1)).cuda()
    assert_close(newton_schulz(g, *COEFFS, 5, 1e-7, backend="triton"), reference(g, 5))

@interpreted
def test_the_symmetric_product_mirrors_its_upper_tiles():
    """alpha Y Y^T + beta Z over three 32-row tiles: the result is symmetric bit for bit (the tiles
    below the diagonal are the stored transposes) and each entry is the fp32 value rounded once."""
    from megaft.kernels.newton_schulz.triton import sym_gram

    gen = torch.Generator().manual_seed(2)
    y = torch.randn(2, 90, 50, generator=gen).bfloat16()
    z = torch.randn(2, 90, 90, generator=gen).bfloat16()
    z = z + z.mT  # symmetric, as the gram the kernel is given
    got = sym_gram(y, 0.5, z, -2.0, block=32, block_k=16)
    assert torch.equal(got, got.mT)
    want = 0.5 * y.double() @ y.double().mT - 2.0 * z.double()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
    assert ((got.double() - want).abs() <= ulp).all()  # within one ulp: the fp32 sum, rounded to nearest


def test_auto_is_torch_on_cpu_and_triton_refused_without_the_interpreter(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("fused", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))


def test_bad_config_is_refused_with_the_fix(monkeypatch):
    optim = OptimConfig(name="muon")
    optim.muon.ns_backend = "cuda"
    assert any("optim.muon.ns_backend='cuda' is unknown; fix: one of torch, triton, auto" in e
               for e in check_optim(optim))
    optim.muon.ns_backend = "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    (err,) = check_fused(optim, device="cpu")
    assert "optim.muon.ns_backend=triton cannot run on this run's cpu device" in err
    assert "fix: optim.muon.ns_backend=torch or auto" in err
    optim.name = "adamw"  # the Newton-Schulz backend of an AdamW run is never used
    assert check_fused(optim, device="cpu") == []
    assert Config().optim.muon.ns_backend == "torch"  # the default: torch.optim.Muon's ops, bitwise
    from megaft.validation import validate

    cfg = Config()  # the whole validation, before any rank starts, reports it (device auto: this CPU here)
    cfg.optim.name, cfg.optim.muon.ns_backend = "muon", "triton"
    assert [p for p in validate(cfg, 1) if "ns_backend" in p] == ([] if torch.cuda.is_available() else [err])


def train(backend: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, weights after, weights before) of 6 Muon steps on a 1-block mixture of experts (2-D
    projections and [E, rows, cols] stacks) with optim.muon.ns_backend=backend."""
    cfg = ModelConfig(arch="mixtral", dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, moe_ffn_dim=24,
                      n_experts=4, top_k=2, vocab_size=40, max_seq_len=16)
    model = Decoder(cfg)
    init_params(model, cfg, seed=3, tp_rank=0, tp_size=1)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = OptimConfig(name="muon", fused="torch", weight_decay=0.1)
    optim.muon.ns_backend = backend
    split = muon_split(model)
    flat = FlatParams(model, weight_decay=optim.weight_decay, device=torch.device("cpu"), **flat_split(split))
    opt = MuonAdamW(flat, optim, split=split)
    gen, losses = torch.Generator().manual_seed(0), []
    for _ in range(6):
        ids = torch.randint(0, 40, (2, 12), generator=gen)
        loss = model.loss_sum(ids, ids)
        loss.backward()
        losses.append(loss.item())
        opt.step(0.02)
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, start


def drift(run, ref) -> float:
    """The largest ||W_run - W_ref|| / ||W_ref - W_0|| over the weights: the runs' difference as a
    fraction of what training moved each weight."""
    (_, got, _), (_, want, start) = run, ref
    return max(((got[n] - want[n]).norm() / (want[n] - start[n]).norm()).item() for n in want)


@interpreted
def test_a_training_run_follows_the_torch_iterations_curve(monkeypatch):
    """The loss curve within 1e-3 relative (measured 3.5e-5) and every weight no further from the torch
    run than a control run is: the torch iteration with one ulp added to 1% of its results' entries
    (per call, the triton path differs by at most that: test_triton_equals_torch_muon). Weights are not
    bounded by the per-call tolerance times the steps: Newton-Schulz maps a gradient's small singular
    directions to unit ones, so a one-ulp difference in a step moves the next steps' updates more; both
    the triton run and the control measure about 8% of what training moved o_proj (the largest)."""
    import megaft.optim.muon as muon

    ref = train("torch")
    triton_run = train("triton")
    assert max(abs(a - b) / b for a, b in zip(triton_run[0], ref[0])) <= 1e-3
    assert ref[0][-1] < ref[0][0]  # the run learns
    torch_ns_backend, gen = muon.newton_schulz, torch.Generator().manual_seed(5)

    def one_ulp_flips(*args, **kw):
        out = torch_ns_backend(*args, **kw)
        flips = (torch.rand(out.shape, generator=gen) < 0.01).to(torch.int16)
        return (out.view(torch.int16) + flips).view(torch.bfloat16)

    monkeypatch.setattr(muon, "newton_schulz", one_ulp_flips)
    control = train("torch")
    assert 0 < drift(triton_run, ref) <= 2 * drift(control, ref)
    assert drift(control, ref) < 0.2  # the control's flips stay small next to training's own moves


def test_the_benchmark_times_equal_computations_and_names_the_gpu_command(capsys):
    """benchmarks.newton_schulz: its `unfolded` path (each axpy its own op: the same GEMMs, so the ratio
    compares equal work) is the reference iteration up to its 4 extra bf16 roundings a step (A A, b A,
    c A A and their sum; a X and B X likewise), each 2^-9 relative: within 2 x 4 x steps x 2^-9 in
    Frobenius norm (measured 3.9%: the folding torch.optim.Muon does is also the more accurate form);
    on CPU the torch ratio is 1 and triton is not timed (interpreted only), with the command a GPU user
    runs."""
    from benchmarks import newton_schulz as bench

    g = torch.randn(40, 100, generator=torch.Generator().manual_seed(3))
    got, want = bench.unfolded(g, *COEFFS, 5, 1e-7).float(), reference(g, 5).float()
    assert 0 < (got - want).norm() <= 2 * 4 * 5 * 2.0 ** -9 * want.norm()
    assert bench.flops_ratio((64, 64)) == 4 / 6  # square: half of X X^T and of A A, the B X product whole
    rows = bench.main(["--device", "cpu", "--scale", "64", "--reps", "1", "--steps", "1"])
    assert [r["shape"] for r in rows] == [[32, 32], [8, 32], [128, 32], [32, 128], [8, 32, 32]]
    assert all(r["ratio"]["torch"] == 1 and r["ratio"]["triton"] is None for r in rows)
    assert "python -m benchmarks.newton_schulz --device cuda" in capsys.readouterr().out


LAYOUTS = {"tp2": dict(tp=2), "dp2_zero3": dict(dp=2, zero=3, bucket_mb=0.01)}


def _triton_config(**par):
    from test_muon import _muon_config

    cfg = _muon_config(**par)
    cfg.optim.muon.ns_backend = "triton"
    cfg.train.max_steps = 3
    return cfg


def _train_layouts(rank: int, world: int, root: str) -> None:
    from test_muon import _fit_and_save
    from train_cases import layout_grid

    for name, par in LAYOUTS.items():
        _fit_and_save(_triton_config(**par), layout_grid(par), os.path.join(root, name))


@interpreted
@pytest.mark.exact  # make test runs it on a pinned CPU code path (docs/contributing.md)
def test_layouts_on_the_triton_path_equal_the_single_process(tmp_path):
    """ns_backend=triton at tp=2 (each shard's update gathered whole, orthogonalised by the kernel on
    every tp rank) and dp=2 ZeRO-3 (the owners' all-gathered updates) against one process on the same
    path, with tests/test_muon.py::test_layout_equals_single_process's bounds: losses within 1e-5
    relative, each Muon matrix within a quarter of its summed step sizes, each AdamW tensor 1% of the
    summed lr (the kernel sees the same whole matrix at every layout; what differs is the fp32
    rounding of its input, carried by bf16 Newton-Schulz as on the torch path)."""
    from multirank import spawn
    from test_muon import _fit_and_save, _whole_weights
    from train_cases import read_metrics

    from megaft.optim.muon import update_scale
    from megaft.optim.schedule import lr_at
    from megaft.parallel.grid import ParallelGrid

    for name in ("single", *LAYOUTS):
        os.makedirs(tmp_path / name)
    _fit_and_save(_triton_config(), ParallelGrid.single(), str(tmp_path / "single"))
    spawn(2, _train_layouts, str(tmp_path))
    cfg = _triton_config()
    lr_sum = sum(lr_at(s, cfg.optim, cfg.train.max_steps) for s in range(cfg.train.max_steps))
    single, _ = read_metrics(str(tmp_path / "single"))
    want = _whole_weights(str(tmp_path / "single"))
    muon = {n for n, w in want.items() if w.dim() == 2 and not n.startswith(("embed_tokens.", "lm_head."))}
    assert len(muon) == 14
    for layout in LAYOUTS:
        got_loss, _ = read_metrics(str(tmp_path / layout))
        assert len(got_loss) == 3 and got_loss == pytest.approx(single, rel=1e-5), layout
        got = _whole_weights(str(tmp_path / layout))
        assert got.keys() == want.keys()
        for name, w in want.items():
            bound = 0.25 * lr_sum * update_scale(w.shape, "original") if name in muon else 0.01 * lr_sum
            assert (got[name] - w).abs().max() <= bound, (layout, name)
