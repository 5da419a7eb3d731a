"""optim.fused routes the optimizer's update through the multi-tensor AdamW (issue 4 part 4):
one `adamw_multi_tensor_` call per step for all of a rank's buffers or ZeRO chunks, on the
backend asked for, for the plain (zero 0) and the sharded (ZeRO 1) optimizer; training with
the cpu and triton (TRITON_INTERPRET=1) kernels follows the torch reference."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from train_cases import read_metrics, small_config  # noqa: E402

import megaft.kernels.adamw as adamw_front  # noqa: E402
from megaft.kernels import _ext, _triton  # noqa: E402
from megaft.parallel.grid import ParallelGrid  # noqa: E402
from megaft.training.loop import Trainer  # noqa: E402

STEPS = 3
# zero=1 at dp=1 still runs ShardedAdamW (its chunks are whole buckets); bucket_mb=0.01 cuts
# the model into many buckets, so the sharded optimizer really passes many tensors.
LAYOUTS = {"zero0": dict(zero=0), "zero1": dict(zero=1, bucket_mb=0.01)}


def _train(run_dir: str, fused: str, calls: list, device: str, **par) -> list[float]:
    """STEPS steps of the tiny model; records (backend, tensors) of every multi-tensor call."""
    cfg = small_config(steps=STEPS)
    cfg.optim.fused, cfg.optim.warmup_steps = fused, 1
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    impl = adamw_front._multi_impl

    def spy(backend):
        inner = impl(backend)

        def run(lists):
            calls.append((backend, len(lists.params)))
            inner(lists)
        return run

    os.makedirs(run_dir, exist_ok=True)
    adamw_front._multi_impl, saved = spy, impl
    try:
        trainer = Trainer(cfg, ParallelGrid.single(device), run_dir)
        trainer.fit()
    finally:
        adamw_front._multi_impl = saved
    n_tensors = len(trainer.parts.optim.optimizer.chunks) if par.get("zero") else len(trainer.parts.optim.flat.groups)
    assert calls == [(fused, n_tensors)] * STEPS  # one call per step, every tensor in it, the asked backend
    return read_metrics(run_dir)[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_backends_train_like_torch_with_one_call_per_step(tmp_path, layout, device):
    # cpu: megaft._C; cuda: megaft._cuda; triton: on GPU, or interpreted on CPU (TRITON_INTERPRET=1,
    # set above). An unavailable one is left out here; its own kernel tests report why.
    compiled = ("cpu", _ext.C.available) if device == "cpu" else ("cuda", _ext.CUDA.available)
    backends = [b for b, ok in (compiled, ("triton", _triton.unavailable_reason(torch.device(device)) is None)) if ok]
    ref_calls: list = []
    ref = _train(str(tmp_path / "torch"), "torch", ref_calls, device, **LAYOUTS[layout])
    assert ref_calls[0][1] > 1  # several buffers / chunks, all in the one call
    assert backends, f"no compiled AdamW kernel is available on {device}: nothing to compare"
    for backend in backends:
        got = _train(str(tmp_path / backend), backend, [], device, **LAYOUTS[layout])
        # Each kernel equals the torch reference to fp32 rounding per update (tests/kernels);
        # over 3 steps that moves the loss by ~1e-7 relative, so 1e-5 is a wide, still tight bound.
        assert got == pytest.approx(ref, rel=1e-5, abs=0), backend
