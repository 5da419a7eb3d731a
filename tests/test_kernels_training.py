"""Training with the fused kernels (kernels.backend=triton, the fused linear cross-entropy)
gives the torch paths' loss curve, and an unavailable kernel backend is a config error.

Without a GPU the Triton kernels run in Triton's CPU interpreter (set here, before any
kernel module is imported), so the model and the run stay tiny: a few steps of the
small config, no evaluation (greedy decoding interpreted would dominate the time).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from train_cases import small_config  # noqa: E402

from megaft.config import ConfigError  # noqa: E402
from megaft.kernels import _triton, dispatch  # noqa: E402
from megaft.parallel.grid import ParallelGrid  # noqa: E402
from megaft.training.loop import Trainer  # noqa: E402
from megaft.validation import validate

STEPS = 3  # step 1's loss checks the forward, steps 2-3 the gradients of the updates before
# fp32: the kernels compute the same math, with their own summation order inside the
# norms' row reductions and the online logsumexp; a few AdamW steps keep that at the
# rounding level. 1e-5 relative is the parallel-equivalence bound.
RTOL = 1e-5
LAYERS = 1  # interpreted kernels are slow on CPU; one block already runs every kernel and linear kind
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_cuda_why = dispatch.cuda_unavailable_reason("linear", torch.device(DEVICE))
needs_triton = pytest.mark.skipif(_triton.unavailable_reason(torch.device(DEVICE)) is not None,
                                  reason=f"triton cannot run here: {_triton.unavailable_reason(torch.device(DEVICE))}")


def _losses(run_dir: str, *, master_weights: bool = False, n_layers: int | None = None, **kernels) -> list[float]:
    cfg = small_config(steps=STEPS, micro=2)
    cfg.device = DEVICE
    cfg.train.global_batch_size, cfg.data.seq_len = 4, 16  # 2 micro-batches of 32 tokens: interpreter-sized
    if master_weights:  # bf16 params and grads (the flat buffers), fp32 masters
        cfg.precision, cfg.optim.master_weights = "bf16", True
    cfg.model.n_layers = n_layers or LAYERS
    for key, value in kernels.items():
        setattr(cfg.kernels, key, value)
    assert validate(cfg, 1) == []
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, ParallelGrid.single(device=DEVICE), run_dir)
    return [trainer.train_step(step)["loss"] for step in range(STEPS)]


@pytest.fixture(scope="module")
def torch_losses(tmp_path_factory):
    return _losses(str(tmp_path_factory.mktemp("torch")), backend="torch")


@pytest.mark.parametrize("kernels", [
    pytest.param(dict(backend="torch", fused_linear_cross_entropy=True, ce_chunk_tokens=100), id="torch-fused-ce"),
    pytest.param(dict(backend="triton"), id="triton", marks=needs_triton),
    # linear=torch: the interpreted GEMMs are checked by "triton" (all ops) and the tp/dp runs below
    pytest.param(dict(backend="triton", linear="torch", fused_linear_cross_entropy=True, ce_chunk_tokens=100),
                 id="triton-fused-ce", marks=needs_triton),
    # every CUDA C++ kernel: rmsnorm, rope, swiglu, the cross-entropy (fused head too) and
    # the cuBLAS wgrad accumulation of the linears (GPU with megaft._cuda only)
    pytest.param(dict(backend="cuda", fused_linear_cross_entropy=True, ce_chunk_tokens=100), id="cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(
                     _cuda_why is not None, reason=f"CUDA kernels cannot run here: {_cuda_why}")]),
])
def test_loss_curve_matches_torch(torch_losses, tmp_path, kernels):
    got = _losses(str(tmp_path), **kernels)
    assert len(got) == len(torch_losses) == STEPS
    assert len(set(torch_losses)) == STEPS  # the updates change the model
    for step, (g, w) in enumerate(zip(got, torch_losses), start=1):
        assert g == pytest.approx(w, rel=RTOL), f"step {step}: {g} vs {w}"


def test_auto_is_torch_on_cpu_and_explicit_backends_are_checked(monkeypatch):
    cfg = small_config(steps=1)
    cfg.device = "cpu"
    assert validate(cfg, 1) == []  # the default kernels.backend=auto is torch on CPU
    cfg.kernels.backend = "cuda"
    problems = validate(cfg, 1)
    assert any("kernels.backend=cuda cannot run rmsnorm, rope, swiglu, cross_entropy, linear on cpu" in p
               for p in problems), problems
    cfg.kernels.backend, cfg.kernels.rope = "auto", "fast"
    assert any("kernels.rope='fast' is unknown" in p for p in validate(cfg, 1))
    cfg.kernels.rope, cfg.kernels.cross_entropy = None, "cuda"
    assert any("kernels.cross_entropy=cuda cannot run cross_entropy on cpu" in p for p in validate(cfg, 1))
    cfg.kernels.cross_entropy = None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg.kernels.backend = "triton"
    problems = validate(cfg, 1)
    assert len([p for p in problems if "kernels.backend=triton" in p]) == 1, problems  # one line for all ops
    assert "TRITON_INTERPRET" in str(ConfigError(problems))


@needs_triton
def test_bf16_autocast_with_triton_tracks_torch():
    """Under bf16 autocast the residual stream stays fp32 (the fused residual add gets the
    attention output cast to it) and every kernel takes the mixed dtypes: the loss of
    one forward + backward stays within bf16 rounding (2e-2) of the torch paths'."""
    from megaft.config.kernels import KernelsConfig
    from megaft.models.decoder import Decoder
    from megaft.models.init import init_params

    cfg = small_config(steps=1).model
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses, grads = {}, {}
    for backend in ("torch", "triton"):
        for fused in (False, True):
            kernels = KernelsConfig(backend=backend, fused_linear_cross_entropy=fused, ce_chunk_tokens=5)
            model = Decoder(cfg, kernels=kernels)
            init_params(model, cfg, seed=0, tp_rank=0, tp_size=1)
            model.to(DEVICE)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model.loss_sum(ids, ids) / ids.numel()
            loss.backward()
            assert loss.dtype == torch.float32
            losses[backend, fused] = loss.item()
            grads[backend, fused] = model.layers[0].mlp.up_proj.weight.grad
    for key, value in losses.items():
        assert value == pytest.approx(losses["torch", False], rel=2e-2), key
        err = ((grads[key] - grads["torch", False]).norm() / grads["torch", False].norm()).item()
        assert err <= 5e-2, (key, err)


@needs_triton
def test_master_weights_fuse_the_bf16_wgrad_and_track_torch(tmp_path, monkeypatch):
    """optim.master_weights (bf16 params, bf16 grads in FlatParams' buffers) with
    kernels.linear=triton: every linear's weight gradient goes through the fused
    accumulation into its bf16 .grad (spied: the buffers and operands are bf16, one call
    per linear per micro-batch), and the loss curve tracks kernels.linear=torch with master
    weights. Tolerance 2e-3 relative (half a bf16 ulp of the loss): both paths run bf16
    GEMMs with fp32 accumulation but round at other points (the fused path: the epilogue
    and the wgrad sum once; torch: dw, then the grad add, the residual add apart; the CPU
    interpreter truncates bf16 stores), differences that stay below the rounding of the
    bf16 numbers a loss averages over; measured 3e-4 over 3 steps (torch with master
    weights vs fp32: 2.3e-4). One layer: interpreted."""
    from megaft.kernels.linear import triton as tl_linear

    real, into = tl_linear.wgrad_accumulate_, []

    def spy(main_grad, dy, x):
        into.append((main_grad.dtype, dy.dtype, x.dtype))
        return real(main_grad, dy, x)

    monkeypatch.setattr(tl_linear, "wgrad_accumulate_", spy)
    want = _losses(str(tmp_path / "torch"), master_weights=True, n_layers=1, linear="torch")
    assert into == []  # torch: autograd computes dw in bf16 and adds it to the bf16 .grad
    got = _losses(str(tmp_path / "triton"), master_weights=True, n_layers=1, linear="triton")
    # q, k, v, o, gate, up, down and the untied head, for each of 2 micro-batches per step
    assert into == [(torch.bfloat16,) * 3] * (STEPS * 2 * 8), into[:3]
    assert len(set(want)) == STEPS and got != want  # the updates change the model; bf16 rounds differ
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g == pytest.approx(w, rel=2e-3), f"step {step}: {g} vs {w}"


# kernels.linear=triton under tp and dp (2 CPU ranks, one spawn): (name, tp, dp, sp, micro,
# zero). dp2 takes micro-batches of 1, so each rank accumulates two backwards into the flat
# buffer before the reducer (armed for the last, many buckets) sums them. (Without a .grad,
# ZeRO-2, the weight gradient goes through autograd: test_linear.py checks that path.)
LINEAR_RUNS = [("tp2", 2, 1, False, 2, 0), ("tp2_sp", 2, 1, True, 2, 0), ("dp2", 1, 2, False, 1, 0)]


def _linear_runs(rank: int, world: int, root: str, want: list[float]) -> None:
    failures = []
    for name, tp, dp, sp, micro, zero in LINEAR_RUNS:
        cfg = small_config(steps=STEPS, micro=micro)
        cfg.train.global_batch_size, cfg.data.seq_len = 4, 16
        cfg.model.n_layers = LAYERS
        cfg.kernels.linear = "triton"
        par = cfg.parallel
        par.tp, par.dp, par.sequence_parallel, par.zero, par.bucket_mb = tp, dp, sp, zero, 0.01
        assert validate(cfg, world) == [], name
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        trainer = Trainer(cfg, ParallelGrid.build(tp=tp, dp=dp, pp=1, device="cpu"), run_dir)
        got = [trainer.train_step(step)["loss"] for step in range(STEPS)]
        if got != pytest.approx(want, rel=RTOL):
            failures.append(f"{name}: {got} vs torch tp=1 {want}")
    assert not failures, "\n".join(failures)


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu", reason="the multi-rank runs are gloo CPU ranks")
def test_fused_linear_loss_curve_under_tp_and_dp(torch_losses, tmp_path):
    """kernels.linear=triton at tp=2 (with and without sequence parallel: the residual add
    stays after the all-reduce / reduce-scatter) and dp=2 (the bucketed reducer's hooks
    fire through the fused weight-gradient accumulation) reproduces the single-process
    torch loss curve within the parallel-equivalence bound."""
    from multirank import spawn

    spawn(2, _linear_runs, str(tmp_path), torch_losses)


@needs_triton
def test_fused_linear_grads_into_flat_buffer():
    """Two backwards (accumulation) of a model with biases and tied embeddings (the head's
    share is fused into the buffer, the embedding's comes through autograd): the flat fp32
    gradient buffers equal the unfused path's, every parameter's post-accumulate-grad hook
    fires once per backward, and the buffers are the same storage as before."""
    from megaft.config.kernels import KernelsConfig
    from megaft.models.decoder import Decoder
    from megaft.models.init import init_params
    from megaft.parallel.data.flat import FlatParams

    cfg = small_config(steps=1).model
    cfg.tie_embeddings = cfg.attention_bias = cfg.mlp_bias = True
    cfg.n_layers = 1  # interpreted: one block has every linear kind
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    grads, hooks = {}, {}
    for backend in ("torch", "triton"):
        model = Decoder(cfg, kernels=KernelsConfig(linear=backend))
        init_params(model, cfg, seed=0, tp_rank=0, tp_size=1)
        model.to(DEVICE)
        flat = FlatParams(model, weight_decay=0.1, device=torch.device(DEVICE))
        storage = [g.grad.data_ptr() for g in flat.groups]
        fired = []
        names = {id(p): n for n, p in model.named_parameters()}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.append(names[id(p)]))
        for _ in range(2):
            (model.loss_sum(ids, ids) / ids.numel()).backward()
        assert [g.grad.data_ptr() for g in flat.groups] == storage
        grads[backend], hooks[backend] = [g.grad.clone() for g in flat.groups], sorted(fired)
    assert hooks["triton"] == hooks["torch"] and len(hooks["torch"]) == 2 * len(names)
    for got, want in zip(grads["triton"], grads["torch"]):
        # fp32, other summation order inside the GEMMs: 1e-5 relative to the largest gradient
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
