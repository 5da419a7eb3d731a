"""The rates megaft.perf.time prices a step at: collectives over the cluster's links and compute on
its device, each corrected by the cluster's calibrated factors (issue 42).

Collectives use the ring formulas with the bandwidth of the slowest link the group
spans (NVLink when the group fits in a node; across nodes the NICs of the group's
ranks in a node, as NCCL runs one ring per NIC), times `cluster.comm_fraction`:
all-reduce 2(n−1)/n·B/bw + 2(n−1)·α, reduce-scatter and all-gather (n−1)/n·B/bw +
(n−1)·α (B: the whole buffer). Groups are laid out as megaft orders ranks (tp fastest,
then cp, dp, pp), so a dp group fits in a node when tp·dp ≤ gpus_per_node and holds
gpus_per_node / tp ranks of each node otherwise.

The calibrated factors (1 in every preset; `plan.calibrate=RUN_DIR` derives them from a finished
run, megaft.plan.calibrate) correct the cited figures without replacing them:

* `cluster.compute_scale` multiplies every compute second: the peak (the FLOPs at matmul_fraction
  and the GEMM curve's waves) and the HBM rate (memory-bound GEMMs, elementwise kernels) are
  divided by it, the launch gap and the eager host's dispatch multiplied. The curves keep their
  shape (a skinny GEMM stays as far below a square one) and move as a whole.
* `cluster.comm_scale` multiplies every collective's and message's time: each link's bandwidth is
  divided by it and its latency per step multiplied.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

from megaft.perf.gemm import GemmCurve
from megaft.perf.hardware import cluster_hbm_tbps, cluster_peak_tflops
from megaft.perf.kernels_cost import KernelCosts


@dataclass(frozen=True)
class Link:
    """One collective's transport: bandwidth in bytes/s and latency per ring step in s."""

    bandwidth: float
    latency: float


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an n-rank group over a buffer of `nbytes`."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def gather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather or reduce-scatter; `nbytes` is the whole (gathered) buffer."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def p2p_s(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency


def _bw(cluster, gbps: float) -> float:
    """Bytes/s a large collective reaches over a link of `gbps`, calibrated."""
    return gbps * 1e9 * cluster.comm_fraction / cluster.comm_scale


def _latency(cluster, us: float) -> float:
    return us * 1e-6 * cluster.comm_scale


def all_to_all_s(sent: float, n: int, cluster, stride: int = 1) -> float:
    """All-to-all of an n-rank group `stride` apart in megaft's rank order, each rank sending
    `sent` bytes to the others, as much to each (uniform routing). Within a node: NVLink,
    sent/bw + (n−1)·α. Across nodes each rank's rows to the other nodes' ranks leave by its
    own NIC while the rest cross NVLink at the same time: the slower of the two, plus the
    (n−1) network steps' latency."""
    if n <= 1:
        return 0.0
    nvlink = _bw(cluster, cluster.nvlink_gbps)
    if n * stride <= cluster.gpus_per_node:
        return sent / nvlink + (n - 1) * _latency(cluster, cluster.nvlink_latency_us)
    per_node = max(1, min(n, cluster.gpus_per_node // stride))  # the group's ranks in one node
    remote = sent * (n - per_node) / (n - 1)
    return (max(remote / _bw(cluster, cluster.ib_gbps), (sent - remote) / nvlink)
            + (n - 1) * _latency(cluster, cluster.ib_latency_us))


def group_link(cluster, size: int, stride: int = 1) -> Link:
    """The link of a group of `size` ranks `stride` apart in megaft's rank order (tp
    fastest: a dp group has stride tp). Within a node: NVLink. Across nodes: NCCL runs
    one ring per NIC, so a group with k ranks in each node moves k NICs' worth, up to
    NVLink's rate."""
    if size * stride <= cluster.gpus_per_node:
        return Link(_bw(cluster, cluster.nvlink_gbps), _latency(cluster, cluster.nvlink_latency_us))
    per_node = max(1, min(size, cluster.gpus_per_node // stride))
    gbps = min(cluster.nvlink_gbps, per_node * cluster.ib_gbps)
    return Link(_bw(cluster, gbps), _latency(cluster, cluster.ib_latency_us))


class ComputeRates(NamedTuple):
    """What a device's compute is priced with at one precision."""

    rate: float  # FLOP/s of the FLOPs no GEMM curve prices (all of them without a curve)
    curve: Optional[GemmCurve]  # GEMMs by shape (megaft.perf.gemm); None: every FLOP at `rate`
    kernels: Optional[KernelCosts]  # elementwise kernels, launches, the eager host; None: not priced


def compute_rates(cluster, precision: str) -> ComputeRates:
    """The rates of a cluster (megaft.config.cluster.ClusterConfig) at `precision`, with its compute_scale."""
    s = cluster.compute_scale
    peak = cluster_peak_tflops(cluster, precision) / s
    hbm = cluster_hbm_tbps(cluster) / s
    kc = KernelCosts.of(cluster, hbm)
    if kc is not None:
        kc = replace(kc, gap=kc.gap * s, op_host=kc.op_host * s)
    return ComputeRates(peak * 1e12 * cluster.matmul_fraction, GemmCurve.of(cluster, precision, peak, hbm), kc)
