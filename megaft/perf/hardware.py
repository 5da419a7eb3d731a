"""One table of devices: what a GPU is, read by the trainer's MFU, validate()'s memory
budget, the Slurm sweep launcher and megaft-plan's cluster presets.

A row carries the facts of one device that do not depend on the node around it: its
`gpu_type` key (hydra.launcher.gpu_type, cluster.gpu_type), the substring of
`torch.cuda.get_device_name` it matches, the memory a run may use, the dense peaks and
the HBM bandwidth. Node facts (links, GPUs per node, host memory) stay in conf/cluster/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

GIB = 2 ** 30


@dataclass(frozen=True)
class Device:
    """One GPU. `memory_gib`: the vendor's memory less the usual driver reserve, rounded
    down (not measured here; a MIG slice or another card: hydra.launcher.gpu_mem_gb).
    `peaks`: dense (no sparsity) TFLOP/s by precision from the vendor's datasheet; fp32 is
    the plain FP32 rate, as torch runs fp32 matmuls without TF32 unless a user allows it
    (then train.peak_tflops / --peak-tflops). `hbm_tbps`: HBM bandwidth from the datasheet."""

    gpu_type: str  # the key Slurm presets and cluster presets name ("" = matched by name only)
    match: Optional[str] = None  # substring of torch.cuda.get_device_name; None = no peaks known
    memory_gib: Optional[float] = None
    peaks: dict = field(default_factory=dict)
    hbm_tbps: Optional[float] = None


_HOPPER = {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}  # H100/H200 SXM: 1,979 bf16 with sparsity, half dense
_A100 = {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}
_V100 = {"fp16": 125.0, "fp32": 15.7}  # no bf16 tensor cores

# Ordered as the memory table always was (its keys are listed in errors in this order);
# name matching takes the longest matching substring ("GH200" contains "H200").
DEVICES: tuple[Device, ...] = (
    Device("t4", memory_gib=14.7),
    Device("v100-16g", "V100", 15.7, _V100),
    Device("v100-32g", "V100", 31.7, _V100),
    Device("a10g", "A10G", 22.1, {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2}),
    Device("l4", memory_gib=22.0),
    Device("l40s", "L40S", 44.3, {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    Device("a100-40g", "A100", 39.3, _A100),
    Device("a100-80g", "A100", 79.1, _A100, hbm_tbps=2.039),  # A100 80GB SXM datasheet: 2,039 GB/s
    Device("h100", "H100", 79.1, _HOPPER, hbm_tbps=3.35),  # H100 SXM datasheet: 3.35 TB/s
    Device("", "H100 PCIe", peaks={"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    Device("h100-nvl", "H100 NVL", 93.1, {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    Device("gh200", "GH200", 94.5, _HOPPER),
    Device("h200", "H200", 139.7, _HOPPER, hbm_tbps=4.8),  # H200 SXM datasheet: 4.8 TB/s
    # HGX B200 datasheet: 8 GPUs = 18 PF bf16 dense, 600 TF fp32; DGX B200: 64 TB/s HBM for 8
    Device("b200", "B200", 178.3, {"bf16": 2250.0, "fp16": 2250.0, "fp32": 75.0}, hbm_tbps=8.0),
    Device("mi250x", memory_gib=63.9),
    Device("mi300x", "MI300X", 191.9, {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
)

# GiB per GPU of each gpu_type (validate()'s budget for a sweep submitted from a login node)
GPU_MEMORY_GIB = {d.gpu_type: d.memory_gib for d in DEVICES if d.gpu_type and d.memory_gib is not None}
_BY_NAME = sorted((d for d in DEVICES if d.match), key=lambda d: -len(d.match))


def device(gpu_type: str) -> Optional[Device]:
    """The row of a gpu_type key (case-insensitive), or None."""
    return next((d for d in DEVICES if d.gpu_type and d.gpu_type == gpu_type.lower()), None)


def device_match(device_name: Optional[str]) -> str:
    """The table's name a GPU name (torch.cuda.get_device_name) matches ("H100"; the longest), "" when none."""
    return next((d.match for d in _BY_NAME if device_name and d.match in device_name), "")


def peak_tflops(device_name: Optional[str], precision: str = "bf16") -> Optional[float]:
    """The dense peak of a GPU name (torch.cuda.get_device_name) for a precision
    (fp32 | bf16 | fp16), or None when unknown."""
    row = next((d for d in _BY_NAME if device_name and d.match in device_name), None)
    return row.peaks.get(precision) if row else None


def device_peak_tflops(dev, precision: str, configured: float = 0.0) -> Optional[float]:
    """train.peak_tflops when set (> 0), else the table's peak of the CUDA device `dev`;
    None on CPU or for an unknown GPU (no MFU then)."""
    if configured > 0:
        return configured
    if getattr(dev, "type", str(dev)) != "cuda":
        return None
    import torch

    return peak_tflops(torch.cuda.get_device_name(dev), precision)


def gpu_type_memory(gpu_type: str) -> tuple[Optional[float], list[str]]:
    """(GiB per GPU of `gpu_type`, problems): the table's entry (case-insensitive), or a
    problem listing the known types when it has none."""
    gib = GPU_MEMORY_GIB.get(gpu_type.lower())
    if gib is not None:
        return gib, []
    return None, [f"hydra.launcher.gpu_type={gpu_type!r} is unknown; fix: one of {', '.join(GPU_MEMORY_GIB)}, "
                  "or hydra.launcher.gpu_mem_gb=<GiB per GPU> for another GPU"]


def with_device_facts(cluster):
    """A copy of `cluster` (megaft.config.cluster.ClusterConfig) whose peaks and HBM bandwidth left
    at 0 are its gpu_type's from the table (the planner's cluster, megaft.plan.shape)."""
    import dataclasses

    peaks = {f"peak_tflops_{p}": cluster_peak_tflops(cluster, p) for p in ("bf16", "fp16", "fp32")}
    return dataclasses.replace(cluster, hbm_tbps=cluster_hbm_tbps(cluster), **peaks)


def cluster_peak_tflops(cluster, precision: str) -> float:
    """A cluster's (megaft.config.cluster.ClusterConfig) dense peak per device at `precision`: the
    preset's or override's `peak_tflops_<precision>` when > 0, else its gpu_type's from the table
    (0 when neither knows it)."""
    own = getattr(cluster, f"peak_tflops_{precision}", 0.0)
    if own or not cluster.gpu_type:
        return own
    row = device(cluster.gpu_type)
    return row.peaks.get(precision, 0.0) if row else 0.0


def peak_ratio(cluster, precision: str) -> float:
    """A cluster's dense peak over its gpu_type's datasheet peak at `precision` (1 when either is unknown).
    A preset that sets a lower peak for a known device describes the same silicon at a lower sustained
    clock (a power-capped part: torchtitan's 500 W H100s, "between SXM and NVL"), so the rates measured on
    the datasheet part that the tensor cores bound (the attention curve, megaft.perf.attention) move with it."""
    own = getattr(cluster, f"peak_tflops_{precision}", 0.0)
    row = device(cluster.gpu_type) if cluster.gpu_type else None
    table = row.peaks.get(precision, 0.0) if row else 0.0
    return own / table if own and table else 1.0


def cluster_hbm_tbps(cluster) -> float:
    """A cluster's device memory bandwidth (TB/s): cluster.hbm_tbps when > 0, else its gpu_type's."""
    if cluster.hbm_tbps or not cluster.gpu_type:
        return cluster.hbm_tbps
    row = device(cluster.gpu_type)
    return row.hbm_tbps or 0.0 if row else 0.0
