"""The attention variants and family differences run on the fused kernel paths
(kernels.backend=triton: RMSNorm incl. qk-norm and the (1 + w) norm, RoPE ahead of the
windowed attention, the fused linears with q/k/v biases; GeGLU keeps to torch ops since
the SwiGLU kernels do not apply): logits and every grad equal the torch paths', and the
logits equal transformers'. Without a GPU Triton runs in its CPU interpreter (set before
any kernel module is imported)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megaft.config.kernels import KernelsConfig  # noqa: E402
from megaft.inference.generate import full_logits  # noqa: E402
from megaft.kernels import _triton  # noqa: E402
from megaft.models.decoder import Decoder  # noqa: E402
from megaft.models.hf.config import hf_model_config  # noqa: E402
from megaft.models.hf.load import load_hf_weights
from models.arch_cases import batch  # noqa: E402
from models.arch_fixture import load_reference, make_hf, sample_ids  # noqa: E402

# fp32: the kernels reduce rows in their own order; 1e-5 is the parallel-equivalence bound.
ATOL = RTOL = 1e-5
# biases, qk-norm + head_dim, window, (1 + w)/GeGLU/scale, soft-caps, sandwich norms + local RoPE
NAMES = ("qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3")
# Half the fixture's width (each family's head_dim, heads and windows kept, the sequences too):
# the interpreter runs every GEMM tile's K loop in Python, and at 64/96 this file took ~140 s.
# N = 48 still leaves a partial 32-wide tile, K = 32 a two-step loop.
NARROW = dict(hidden_size=32, intermediate_size=48)
pytestmark = pytest.mark.skipif(_triton.unavailable_reason(torch.device("cpu")) is not None,
                                reason="Triton (interpreted on CPU) is not available")


@pytest.mark.parametrize("name", NAMES)
def test_triton_kernels_match_torch_and_transformers(tmp_path, name):
    path = str(tmp_path / name)
    make_hf(path, name, **NARROW)
    cfg = hf_model_config(path)
    ids, (lines, labels) = sample_ids(), batch()
    logits, grads = {}, {}
    for backend in ("torch", "triton"):
        model = Decoder(cfg, kernels=KernelsConfig(backend=backend, autotune=False))
        load_hf_weights(model, path, tp_rank=0, tp_size=1)
        with torch.no_grad():
            logits[backend] = full_logits(model, ids)
        (model.loss_sum(lines, labels) / (labels != -100).sum()).backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():
        torch.testing.assert_close(logits["triton"], load_reference(path)(ids).logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=ATOL, rtol=RTOL)
    for n, g in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][n], g, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")
