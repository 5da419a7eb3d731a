"""Model FLOPs per token and device peaks: the two halves of MFU.

MFU = tokens/s * model FLOPs per token / (ranks * peak FLOP/s), the PaLM paper's
definition (appendix B): the FLOPs the model needs, not what the hardware ran, so
activation recomputation, padding and pipeline bubbles lower MFU instead of
inflating it. Used by the trainer (metrics lines, summary.json) and megaft-report.
"""
from __future__ import annotations

from typing import Optional

from megaft.models.config import ModelConfig
from megaft.peft.config import LoraConfig, adapter_layer_params, head_adapter_params

# Dense (no sparsity) peaks in TFLOP/s per GPU from vendor datasheets, SXM/OAM parts
# unless named. fp32 is the plain FP32 rate: torch runs fp32 matmuls without TF32
# unless a user allows it (then pass train.peak_tflops / --peak-tflops).
# Matched as substrings of torch.cuda.get_device_name, first match wins, so the
# longer names come first ("GH200" contains "H200", "H100 PCIe" contains "H100").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 75.0}),  # HGX B200: 8 GPUs = 18 PF bf16, 600 TF fp32
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # no bf16 tensor cores
)


def matmul_params(m: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every linear of every block and the
    output head (the embedding lookup is a gather; a tied head still multiplies)."""
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd  # GQA: k and v project to kv heads only
    attn = m.dim * q + 2 * m.dim * kv + q * m.dim
    mlp = 3 * m.dim * m.ffn_dim  # SwiGLU: gate, up, down
    return m.n_layers * (attn + mlp) + m.dim * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int, lora: Optional[LoraConfig] = None) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus attention
    scores and values, 2 matmuls of n_heads * head_dim * seq_len each, times 2 FLOPs and 3
    passes = 12 * layers * n_heads * head_dim * seq_len (PaLM counts the full square, not
    the causal half; query heads count, GQA shares only the k/v projections).

    Under LoRA (`lora.rank` > 0) the frozen weights need no weight gradient: 4 per base
    weight (forward and input gradient), and 6 per adapter parameter."""
    attention = 12.0 * m.n_layers * m.n_heads * m.hd * seq_len
    if lora is None or lora.rank <= 0:
        return 6.0 * matmul_params(m) + attention
    adapters = m.n_layers * adapter_layer_params(m, lora, 1)[0] + head_adapter_params(m, lora, m.vocab_size)
    return 4.0 * matmul_params(m) + 6.0 * adapters + attention


def flops_per_token_from_params(params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """The same count from a summary without the shape (older summary.json files):
    6 * all params + 12 * layers * dim * seq_len."""
    return 6.0 * params + 12.0 * n_layers * dim * seq_len


def peak_tflops(device_name: Optional[str], precision: str = "bf16") -> Optional[float]:
    """The dense peak of a GPU name for a precision (fp32 | bf16 | fp16), or None when unknown."""
    for key, peaks in PEAK_TFLOPS:
        if device_name and key in device_name:
            return peaks.get(precision)
    return None


def device_peak_tflops(device, precision: str, configured: float = 0.0) -> Optional[float]:
    """train.peak_tflops when set (> 0), else the table's peak of the CUDA `device`;
    None on CPU or for an unknown GPU (no MFU then)."""
    if configured > 0:
        return configured
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return peak_tflops(torch.cuda.get_device_name(device), precision)


def mfu(tokens_per_s: float, flops_per_tok: float, ranks: int, peak: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the ranks' summed peak (TFLOP/s)."""
    return tokens_per_s * flops_per_tok / (ranks * peak * 1e12)
