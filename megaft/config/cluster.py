"""ClusterConfig (`cluster.*`, presets in conf/cluster/) and PlanConfig (`plan.*`):
what `megaft-plan` plans for. Config-layer leaves: the root Config composes them, so
one set of overrides serves megaft-train and megaft-plan alike.

The defaults describe no cluster (zeros): megaft-train never reads `cluster`, and
megaft-plan asks for a preset (`cluster=h100 cluster.nodes=8`). Bandwidths are per
device and per direction, in GB/s (1e9 bytes/s); memory sizes are vendor GB (1e9 bytes).
The device's own facts (peaks, HBM bandwidth, memory) come from megaft.perf.hardware's
table by `gpu_type` unless a preset or override sets them (> 0: cluster_peak_tflops,
cluster_hbm_tbps there); presets hold the node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

PRECISIONS = ("bf16", "fp16", "fp32")


@dataclass
class ClusterConfig:
    name: str = "none"  # preset name, informational
    nodes: int = 1  # nodes the job gets; the planner uses nodes * gpus_per_node ranks
    gpus_per_node: int = 0  # devices (one rank each) per node; 0 = no cluster chosen
    gpu_type: str = ""  # megaft.perf.hardware key: peaks, HBM and the memory budget as Slurm sweeps use; "" = hbm_gb
    hbm_gb: float = 0.0  # device memory from the datasheet (GB), the budget when gpu_type is ""
    hbm_tbps: float = 0.0  # device memory bandwidth (TB/s): the optimizer step's time; 0 = gpu_type's
    peak_tflops_bf16: float = 0.0  # dense (no sparsity) peak TFLOP/s per device at bf16; 0 = gpu_type's
    peak_tflops_fp16: float = 0.0  # same at fp16
    peak_tflops_fp32: float = 0.0  # same at plain fp32 (torch runs fp32 matmuls without TF32)
    # achievable fraction of the peak for the FLOPs no GEMM curve prices: every FLOP when gemm_sms
    # is 0, else the attention core and what megaft.perf.gemm.block_linears does not list
    matmul_fraction: float = 0.0
    # GEMM efficiency by shape (megaft.perf.gemm); gemm_sms = 0: no curve (every FLOP at matmul_fraction)
    gemm_ceiling: float = 0.0  # fraction of the dense peak a large, wave-filling GEMM reaches (measured MAMF)
    gemm_tile_m: int = 128  # output tile rows of one thread block (cuBLASLt's 128x256 tile, conf/cluster/h100.yaml)
    gemm_tile_n: int = 256  # output tile columns of one thread block
    gemm_sms: int = 0  # streaming multiprocessors: tiles run this many at a time (waves)
    # the attention core by sequence length (megaft.perf.attention): a flash kernel's measured TFLOP/s at
    # these sequence lengths (bf16, head dim 128); empty = the core at matmul_fraction, whole rows
    attention_seq: List[int] = field(default_factory=list)
    attention_fwd_tflops: List[float] = field(default_factory=list)  # forward, no mask (FLOPs 4 s^2 d h)
    attention_fwd_causal_tflops: List[float] = field(default_factory=list)  # causal forward (FLOPs counted at half)
    attention_bwd_tflops: List[float] = field(default_factory=list)  # backward, no mask (FLOPs 2.5 x the forward's)
    # elementwise, norm and loss kernels by bytes over HBM (megaft.perf.kernels_cost); 0 = not priced
    hbm_fraction: float = 0.0  # achievable fraction of hbm_tbps for a memory-bound kernel (measured)
    kernel_gap_us: float = 0.0  # GPU idle between two back-to-back kernels (launch), per kernel
    # fused kernels (Megatron's, or torch.compile'd blocks); false = eager PyTorch: unfused norms,
    # rotary and activations, and the host's per-op dispatch (eager_op_us) the GPU may wait on
    compiled: bool = True
    eager_op_us: float = 0.0  # host time to dispatch one eager op (compiled: false only)
    # tp collectives hidden behind the whole adjacent GEMMs (Megatron/TransformerEngine's tp_comm_overlap, for
    # the published rows); megaft's own overlap is parallel.tp_overlap=ring, priced by its ring steps whatever
    # this says, so megaft's plans keep this false
    tp_overlap: bool = False
    # model.recompute=selective priced as torchtitan's op-level policy (every second matmul and the elementwise
    # ops run again, the attention core saved; megaft.perf.op_recompute); megaft's runtime lacks it: keep false
    recompute_ops: bool = False
    # ZeRO-1/2's gradient reduction hidden behind each pp rank's last backward at pp > 1, and the parameter
    # all-gather behind the next step's first forward (Megatron's --overlap-grad-reduce --overlap-param-gather);
    # megaft's runtime reduces after the schedule and gathers after the step: its own plans keep this false
    dp_overlap: bool = False
    nvlink_gbps: float = 0.0  # intra-node link, GB/s per device per direction
    nvlink_latency_us: float = 0.0  # per ring step inside a node
    ib_gbps: float = 0.0  # inter-node network, GB/s per device per direction (one NIC per GPU)
    ib_latency_us: float = 0.0  # per ring step across nodes
    comm_fraction: float = 0.0  # achievable fraction of a link's bandwidth for large collectives
    pcie_gbps: float = 0.0  # host link, GB/s per device per direction (parallel.offload=cpu traffic)
    host_memory_gbps: float = 0.0  # a node's DRAM bandwidth (GB/s), shared by its ranks: the offloaded AdamW
    # a megaft-commbench run dir (or its commbench.json): its measured intra-/inter-node all-reduce bus
    # bandwidth and latency replace nvlink_*/ib_* (megaft.plan.measured); null = the datasheet's
    measured: Optional[str] = None
    # calibrated factors (megaft.perf.rates; plan.calibrate=RUN_DIR derives them from a finished run and
    # prints them as these overrides): 1 = the preset's cited figures as they are
    compute_scale: float = 1.0  # multiplies every compute second (GEMMs, attention, elementwise kernels, launches)
    comm_scale: float = 1.0  # multiplies every collective's and p2p message's time (bandwidth and latency)
    optimizer_scale: float = 1.0  # multiplies the AdamW update's time (its bytes over HBM)
    step_overhead_s: float = 0.0  # seconds per step outside every phase (data, logging): the `overhead` term

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class PlanConfig:
    top_k: int = 5  # layouts printed and written to plan.json
    explain: bool = False  # also show the rule-of-thumb layout and why it lost
    max_tp: int = 0  # largest tp tried (divisors of gpus_per_node); 0 = gpus_per_node (tp within a node)
    max_vpp: int = 4  # largest interleaved chunk count per pp rank tried (1, 2, 4, ...)
    max_cp: int = 8  # largest context-parallel degree tried (1, 2, 4, ...; data.seq_len must allow it)
    # cp > 1 only while each rank keeps at least this many tokens of a row: shorter shards lose
    # kernel efficiency the cost model does not see (Megatron advises cp for long contexts only)
    min_cp_tokens: int = 4096
    max_micro_batch_size: int = 8  # largest train.micro_batch_size tried (divisors of the global batch)
    zero_stages: List[int] = field(default_factory=lambda: [0, 1, 2, 3])  # parallel.zero values tried
    offload: bool = True  # also try parallel.offload=cpu
    # processes the search checks and costs layouts in (forked, same result as one);
    # 0 = the CPUs this process may use, at most 8 (beyond, forking costs more than it saves)
    workers: int = 0
    # plan.probe=K: run the top K as one short Slurm array and re-rank by measured throughput
    # (megaft.plan.probe; the launcher is megaft-plan's hydra/launcher=..., default slurm); 0 = don't
    probe: int = 0
    probe_steps: int = 6  # optimizer steps per probe run (the first is warm-up and not measured)
    probe_timeout_min: float = 60.0  # wait at most this long for the probe array, then cancel it
    # a finished megaft-train run dir (or a megaft-plan calibration.json): its measured phase times
    # set cluster.compute_scale, comm_scale, optimizer_scale and step_overhead_s (megaft.plan.calibrate)
    calibrate: Optional[str] = None
    # a vision-language model.init_from (docs/vision.md): images in each conversation of the global batch,
    # and their size in pixels [height, width] (Qwen2.5-VL: resized as its processor resizes them; Gemma 3's
    # tower resizes every image to its image_size, so image_size does not apply to it)
    images_per_sample: int = 1
    image_size: List[int] = field(default_factory=lambda: [448, 448])


def check_plan(cfg: PlanConfig) -> list[str]:
    problems = []
    for name in ("top_k", "max_vpp", "max_cp", "min_cp_tokens", "max_micro_batch_size"):
        if getattr(cfg, name) < 1:
            problems.append(f"plan.{name}={getattr(cfg, name)} must be >= 1")
    if cfg.probe < 0 or cfg.probe_steps < 2 or cfg.probe_timeout_min <= 0:
        problems.append(f"plan.probe={cfg.probe} must be >= 0, plan.probe_steps={cfg.probe_steps} >= 2 (the first "
                        f"step is warm-up) and plan.probe_timeout_min={cfg.probe_timeout_min} > 0")
    if cfg.workers < 0:
        problems.append(f"plan.workers={cfg.workers} must be >= 0 (0 = the CPUs this process may use)")
    if cfg.max_tp < 0:
        problems.append(f"plan.max_tp={cfg.max_tp} must be >= 0 (0 = gpus_per_node)")
    bad = [z for z in cfg.zero_stages if z not in (0, 1, 2, 3)]
    if bad or not cfg.zero_stages:
        problems.append(f"plan.zero_stages={list(cfg.zero_stages)} must be a non-empty list of 0, 1, 2, 3")
    if cfg.images_per_sample < 0 or len(cfg.image_size) != 2 or min(cfg.image_size, default=0) < 1:
        problems.append(f"plan.images_per_sample={cfg.images_per_sample} must be >= 0 and plan.image_size="
                        f"{list(cfg.image_size)} two positive pixel counts [height, width]")
    return problems
