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

from megaft.config import ConfigError, validate  # noqa: E402
from megaft.kernels import _triton  # noqa: E402
from megaft.parallel.grid import ParallelGrid  # noqa: E402
from megaft.training.loop import Trainer  # noqa: E402
from train_cases import small_config  # noqa: E402

STEPS = 3  # step 1's loss checks the forward, steps 2-3 the gradients of the updates before
# fp32: the kernels compute the same math, with their own summation order inside the
# norms' row reductions and the online logsumexp; a few AdamW steps keep that at the
# rounding level. 1e-5 relative is the parallel-equivalence bound.
RTOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(_triton.unavailable_reason(torch.device(DEVICE)) is not None,
                                  reason=f"triton cannot run here: {_triton.unavailable_reason(torch.device(DEVICE))}")


def _losses(run_dir: str, **kernels) -> list[float]:
    cfg = small_config(steps=STEPS, micro=2)
    cfg.device = DEVICE
    cfg.train.global_batch_size, cfg.data.seq_len = 4, 16  # 2 micro-batches of 32 tokens: interpreter-sized
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
    pytest.param(dict(backend="triton", fused_linear_cross_entropy=True, ce_chunk_tokens=100), id="triton-fused-ce",
                 marks=needs_triton),
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
    assert any("kernels.backend=cuda cannot run rmsnorm, rope, swiglu on cpu" in p for p in problems), problems
    cfg.kernels.backend, cfg.kernels.rope = "auto", "fast"
    assert any("kernels.rope='fast' is unknown" in p for p in validate(cfg, 1))
    cfg.kernels.rope, cfg.kernels.cross_entropy = None, "cuda"
    assert any("cross_entropy has no CUDA C++ kernel" in p for p in validate(cfg, 1))
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
    from megaft.kernels.config import KernelsConfig
    from megaft.models.init import init_params
    from megaft.models.llama import Llama

    cfg = small_config(steps=1).model
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses, grads = {}, {}
    for backend in ("torch", "triton"):
        for fused in (False, True):
            kernels = KernelsConfig(backend=backend, fused_linear_cross_entropy=fused, ce_chunk_tokens=5)
            model = Llama(cfg, kernels=kernels)
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
