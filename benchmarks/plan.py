"""The planner's cost model against Megatron-LM's and torchtitan's published H100 numbers.

    python -m benchmarks.plan [--cluster h100] [--matmul-fraction F] [--megatron-attention cudnn|fa2]

Every row is priced twice ("before", "after"), each in its framework's mode: Megatron's rows compiled
(its fused kernels) with its tp communication overlapped with the whole GEMMs (cluster.tp_overlap; megaft's
own overlap, parallel.tp_overlap=ring, hides each ring step behind one chunk's GEMM only, and is off by default);
torchtitan's rows eager (no torch.compile) or compiled as published, on their 2.4 TB/s HBM2e.
Both: the GEMM curve (megaft.perf.gemm) for every linear, the elementwise, norm and loss kernels by bytes
over HBM plus a launch gap per kernel (megaft.perf.kernels_cost), and the attention core by a flash kernel's
measured causal curve (megaft.perf.attention): torchtitan's rows FlashAttention-2, which PyTorch's
SDPA flash backend runs (the preset's curve), Megatron's rows cuDNN's fused attention, which
TransformerEngine runs on H100 (assumed: the table does not say; `--megatron-attention fa2` prices
them with FlashAttention-2 instead), both from the same published benchmark (FlashAttention-3
paper, Figures 5 (c), (d) and 6 (b), H100 SXM5, head dim 128, the head dim of every row here).
What "before" and "after" differ by, per source, is said below (Megatron: cluster.dp_overlap; torchtitan: the
500 W part's peak at the two ends of its footnote).
The published rows are a held-out test: no parameter of either model was fitted to them row by
row (matmul_fraction 0.7 was calibrated on the whole Megatron table's mean before the curve
existed; the other parameters are cited in conf/cluster/).

Source: NVIDIA/Megatron-LM, README "Performance Benchmarking", images/model_table.png
(added in commit f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, 2024-07-15): GPT models with a
131,072-token vocabulary and 4096-token sequences on H100 (DGX), "fine-grained
overlapping" of the DP, TP and PP communication, throughput end to end. Each row below is
(name, attention heads, hidden size, layers, tp, pp, dp, GPUs, global batch, per-GPU
TFLOP/s, MFU) as printed in that table.

For every row the layout is fed to megaft's cost model (megaft.perf.time.step_cost) on
conf/cluster/<cluster>.yaml: a Llama-shaped model with the same FLOPs (multi-head
attention, SwiGLU width 8/3 x hidden = GPT's 4 x hidden MLP), bf16, micro-batch 1,
sequence parallelism with tp, ZeRO-1 (Megatron's distributed optimizer) with bf16
params and fp32 gradient reduction. The model predicts megaft's step, so it differs from
Megatron where megaft differs: megaft overlaps no tp collective by default, and its opt-in ring
(parallel.tp_overlap=ring) less than Megatron's userbuffers (both columns turn on cluster.tp_overlap,
the like-for-like setting, for these rows), overlaps no parameter
all-gather with the next forward, and reduces pp > 1 gradients after the schedule ("after" turns on
cluster.dp_overlap, the like-for-like setting for those two); the
interleaving and micro-batch size of the published runs are not in the table (1 and 1 assumed here).
Only the cost is compared: megaft's memory estimate (no activation recomputation) is
not applied to these layouts.

Second source: pytorch/torchtitan, docs/performance.md, Tables 1 and 3 (bf16 rows, no
torch.compile, no Float8): Llama 3.1 8B (seq 8192) with FSDP2 on 8 and 128 H100s, local
batch 2, selective activation checkpointing, TPS/GPU as printed. Fed as ZeRO-3 over all
GPUs (FSDP: bf16 params, fp32 reduction), micro-batch 2, model.recompute=selective. Those
H100s ran at 500 W with 96 GB HBM2e at 2.4 TB/s ("We ran our performance benchmarks on the Grand
Teton platform", same page) where conf/cluster/h100.yaml describes the 700 W SXM part at 3.35 TB/s:
"after" prices their memory-bound kernels at 2.4 TB/s; the 500 W power limit's effect on the GEMMs
is not modelled (no published measurement of bf16 GEMM throughput against an H100 power cap found).
torchtitan's rows, both with torchtitan's selective "op" policy as the framework runs it (cluster.recompute_ops:
every second matmul of the block and its elementwise ops run again, the attention core saved;
megaft.perf.op_recompute cites torchtitan's policy): "before" at the SXM part's peak (989 TFLOP/s), "after" at the
H100 NVL's (835, megaft.perf.hardware), the two ends of torchtitan's footnote 2 ("the actual peak TFLOPs number is
between SXM and NVL"): the GEMM curve, the FLOPs at matmul_fraction and the attention curve run at the capped clock
(megaft.perf.hardware.peak_ratio), the HBM-bound kernels do not. Megatron's rows, with the attention curve, print
"before" without and "after" with cluster.dp_overlap: the README's "--overlap-grad-reduce --overlap-param-gather"
(the reduction behind each pp rank's last backward at pp > 1 too, the parameter all-gather behind the next step's
first forward), which megaft's runtime lacks.
(The table's CP rows use Float8 and torch.compile: not comparable with a bf16 peak, left out.)

Third source (DeepSpeed): BLOOM-176B, trained with Megatron-DeepSpeed on 384 A100 80GB GPUs. Every value below
re-read in its primary source (issue 42):
- the launch script, bigscience-workshop/bigscience train/tr11-176B-ml/tr11-176B-ml.slurm
  (https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/tr11-176B-ml.slurm): 48 nodes
  x 8 GPUs, TP_SIZE=4, PP_SIZE=12 (so dp 8), MICRO_BATCH_SIZE=2, GLOBAL_BATCH_SIZE=2048, NHIDDEN=14336,
  NLAYERS=70, NHEADS=112, SEQ_LEN=2048, --bf16, --checkpoint-activations, --pad-vocab-size-to 250880,
  --pp-partition-method 'type:transformer|embedding', ZERO_STAGE=0 ("bf16 must use z0! it implements its own
  zero stage 1 equivalent": DeepSpeed's BF16Optimizer, fed here as ZeRO-1), CUDA_LAUNCH_BLOCKING=1;
- "The Technology Behind BLOOM Training" (S. Bekman, https://huggingface.co/blog/bloom-megatron-deepspeed):
  "a pipeline of 72 layers, 2 of which were dedicated to the embedding (first and last)" (so the first and last
  of the 12 stages hold 5 blocks and the embedding or the tied head, the others 6: parallel.pp_layers);
  "Sequence parallelism was developed after BLOOM was trained so not used"; Megatron's fused kernels
  (LayerNorm, scale-mask-softmax, bias+GeLU) -> compiled; DeepSpeed's pipeline engine; "4 OmniPath links" per node;
- the BLOOM paper (arXiv:2211.05100, p. 18): "4 Omni-Path 100 Gbps links" per node of 8 A100s, so 4 x 12.5 GB/s
  shared by 8 GPUs: 6.25 GB/s per GPU for the network (JEAN_ZAY_OPA_GBPS; the a100 preset's is 25);
- the throughput, "training throughput: about 150 TFLOPs" (https://bigscience.notion.site/BigScience-176B-Model-
  ad073ca07cdf479398d5f95d88e218c4), at GBS 2048 ("we ramped up to GBS=2048 (150 TFLOPs)", stas00/ml-engineering,
  training/hparams.md). Megatron-DeepSpeed's printed TFLOPs count the recompute (its formula's
  checkpoint_activations_factor 4), so the row is compared as tokens/s per GPU:
  150e12 / (96 l h^2 (1 + s/6h + V/16lh)).
Megatron-DeepSpeed of 2022 issues its tp all-reduces in line with the compute (its mpu layers; TransformerEngine's
tp overlap came later), so the row runs with tp_overlap off. Fed as a Llama-shaped model with the same FLOPs
(SwiGLU 8/3 x hidden for BLOOM's GeLU 4 x hidden MLP, RoPE for ALiBi), recompute=full, ZeRO-1, tied embeddings, on
conf/cluster/a100.yaml with Jean Zay's network.

Fourth source (MoE): NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md, "25.11 NeMo Container",
"System: DGX-H100", the only BF16 row of that table: "| GPT OSS 120B | 64 | BF16 | 512 | 4 | 4096 | 0 | 1 | 4 | 1 |
1 | 8 | 2 | 5630 | 153 |" (GPUs, precision, GBS, MBS, seq, FSDP, TP, PP, CP, VP, EP, GA, tokens/s/GPU, model
TFLOP/s/GPU; the page says the MoE rows "force-balance the token distribution among experts"). The row is not
self-consistent: 64 GPUs at pp 4 leave dp 16, so GBS 512 at MBS 4 is GA 8, not 2 (GA 2 and MBS 4 are the B200 row's,
which has pp 1). The recipe that produced it (scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py,
GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1) sets pp 4, ep 8, expert tp 1, recompute_modules ["layernorm", "moe_act"]
and keeps the base micro_batch_size=1; the table's MBS 4 is kept (printed), micro-batch 1 reported beside it.
gpt-oss-120b's shape re-read in transformers' GptOssConfig (src/transformers/models/gpt_oss/configuration_gpt_oss.py,
"defaults ... similar to ... GPT-OSS-120B"): 36 layers, hidden 2880, 64 query and 8 kv heads of 64, 128 experts
of inner size 2880, top 4, vocabulary 201,088, sliding window 128 on every other layer (layer_types), untied,
attention biases. Fed as megaft's MoE with those shapes (no attention sinks, no biases), pp 4, ep 8, ZeRO-1,
Megatron's mode (compiled, tp_overlap).

torchtitan's rows re-read in pytorch/torchtitan's docs/performance.md at 820504e20^ (the page moved to
benchmarks/llama3_h100_202412_torchtitan.md in that commit): Tables 1 and 3 as above; "96GB HBM2e with 2.4 TB/sec",
"the default 500W power limit"; footnote 2: "we used HBM2e-based SXM H100 with lower TDP, the actual peak TFLOPs
number is between SXM and NVL, and we don't know its exact value"; torch at 1963fc8 (2024/12/23).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from omegaconf import OmegaConf

from megaft.config import Config
from megaft.config.cluster import ClusterConfig
from megaft.config.model import ModelConfig
from megaft.perf.time import step_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN, VOCAB = 4096, 131072
# name, heads, hidden, layers, tp, pp, dp, GPUs, batch, TFLOP/s per GPU, MFU (Megatron-LM model_table.png)
MEGATRON_H100 = (
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
)

# GPUs, global batch, TPS/GPU, torch.compile (torchtitan docs/performance.md, Llama 3.1 8B, FSDP, bf16: the
# "FSDP" and "FSDP + torch.compile" rows of Tables 1 and 3; the Float8 rows left out)
TORCHTITAN_8B = ((8, 16, 5762, False), (128, 256, 5605, False), (8, 16, 6667, True), (128, 256, 6514, True))
LLAMA31_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
TORCHTITAN_SEQ = 8192
# BLOOM-176B (Megatron-DeepSpeed, A100 80GB): heads, hidden, layers, vocab, seq, tp, pp, dp, micro, global, TFLOP/s
BLOOM_176B = dict(heads=112, hidden=14336, layers=70, vocab=250880, seq=2048, tp=4, pp=12, dp=8, micro=2,
                  batch=2048, tflops=150.0, pp_layers=[5] + [6] * 10 + [5])
JEAN_ZAY_OPA_GBPS = 4 * 100 / 8 / 8  # BLOOM paper p. 18: 4 Omni-Path 100 Gb/s links per node of 8 GPUs, GB/s per GPU
# gpt-oss-120b on 64 DGX-H100 GPUs, BF16 (Megatron-Bridge performance-summary.md, 25.11): tokens/s/GPU
GPT_OSS_120B = dict(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880, vocab_size=201088,
                    n_experts=128, top_k=4, moe_ffn_dim=2880, sliding_window=128)
GPT_OSS_ROW = dict(gpus=64, batch=512, micro=4, seq=4096, tp=1, pp=4, ep=8, tps=5630)
GRAND_TETON_HBM_TBPS = 2.4  # torchtitan docs/performance.md: "96GB HBM2e with 2.4 TB/sec peak memory bandwidth"
# torchtitan docs/performance.md footnote 2: the 500 W part's peak "is between SXM and NVL" (megaft.perf.hardware)
GRAND_TETON_PEAK_BOUNDS = (989.4, 835.0)  # H100 SXM and H100 NVL dense bf16 TFLOP/s
# cuDNN's fused attention on H100 SXM5, bf16, head dim 128, TFLOP/s (FlashAttention-3 paper, arXiv:2407.08608,
# cuDNN 9.1.1.17 bars of Figure 5 (c) forward, (d) causal forward, Figure 6 (b) backward); the same
# sequence lengths as conf/cluster/h100.yaml's FlashAttention-2 curve
CUDNN_ATTENTION = dict(attention_fwd_tflops=[497, 574, 617, 609, 600, 595],
                       attention_fwd_causal_tflops=[315, 410, 484, 518, 529, 539],
                       attention_bwd_tflops=[305, 408, 465, 499, 518, 516])


def load_cluster(name: str) -> ClusterConfig:
    data = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "conf", "cluster", f"{name}.yaml")))
    data.pop("defaults", None)
    return ClusterConfig(**data)


def row_config(heads: int, hidden: int, layers: int, tp: int, pp: int, dp: int, batch: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(name="gpt", dim=hidden, n_layers=layers, n_heads=heads, ffn_dim=round(8 * hidden / 3),
                            vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = tp, pp, dp
    cfg.parallel.sequence_parallel, cfg.parallel.zero = tp > 1, 1
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, batch
    cfg.data.seq_len, cfg.precision, cfg.optim.master_weights = SEQ_LEN, "bf16", True
    return cfg


def torchtitan_config(gpus: int, batch: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(name="llama3.1-8b", max_seq_len=TORCHTITAN_SEQ, recompute="selective", **LLAMA31_8B)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = 1, 1, gpus, 3
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, batch
    cfg.data.seq_len, cfg.precision, cfg.optim.master_weights = TORCHTITAN_SEQ, "bf16", True
    return cfg


def bloom_config() -> Config:
    b = BLOOM_176B
    cfg = row_config(b["heads"], b["hidden"], b["layers"], b["tp"], b["pp"], b["dp"], b["batch"])
    cfg.model.vocab_size, cfg.model.max_seq_len, cfg.model.recompute = b["vocab"], b["seq"], "full"
    cfg.model.tie_embeddings = True  # BLOOM ties its word embeddings to the output head
    # 72 pipeline partitions, the embedding and the tied head one each (BLOOM blog): 5 blocks on the end stages
    cfg.parallel.pp_layers = list(b["pp_layers"])
    cfg.parallel.sequence_parallel = False  # "developed after BLOOM was trained so not used" (BLOOM blog)
    cfg.train.micro_batch_size, cfg.data.seq_len = b["micro"], b["seq"]
    return cfg


def bloom_tokens_per_s() -> float:
    """BLOOM's published TFLOP/s per GPU as tokens/s per GPU by Megatron-DeepSpeed's own formula
    (training.py's throughput print with checkpoint_activations_factor 4: 96 l h^2 (1 + s/6h + V/16lh))."""
    b = BLOOM_176B
    h, n, s, v = b["hidden"], b["layers"], b["seq"], b["vocab"]
    return b["tflops"] * 1e12 / (96 * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)))


def gpt_oss_config() -> Config:
    r = GPT_OSS_ROW
    cfg = Config()
    layer_types = ["sliding_attention", "full_attention"] * (GPT_OSS_120B["n_layers"] // 2)
    cfg.model = ModelConfig(name="gpt-oss-120b", max_seq_len=r["seq"], layer_types=layer_types, **GPT_OSS_120B)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.zero = r["tp"], r["pp"], r["ep"], 1
    cfg.parallel.dp = r["gpus"] // (r["tp"] * r["pp"])
    cfg.train.micro_batch_size, cfg.train.global_batch_size = r["micro"], r["batch"]
    cfg.data.seq_len, cfg.precision, cfg.optim.master_weights = r["seq"], "bf16", True
    return cfg


def other_rows(a100: ClusterConfig, h100: ClusterConfig) -> dict:
    """The DeepSpeed (BLOOM-176B, A100) and MoE (gpt-oss-120b, H100) rows: predicted against published
    tokens/s per GPU; returns name -> relative error."""
    print("\nother published sources (tokens/s per GPU)")
    print(f"{'row':>34} {'GPUs':>5} {'published':>10} {'predicted':>10} {'error':>7}  bottleneck (2nd)")
    errors = {}
    rows = (("BLOOM-176B Megatron-DeepSpeed A100", bloom_config(), a100, bloom_tokens_per_s()),
            ("gpt-oss-120b Megatron-Bridge H100", gpt_oss_config(), h100, float(GPT_OSS_ROW["tps"])))
    for name, cfg, cluster, tps in rows:
        gpus = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
        cost = step_cost(cfg, cluster, gpus)
        errors[name] = (cost.tokens_per_s_per_gpu - tps) / tps
        print(f"{name:>34} {gpus:>5} {tps:>10,.1f} {cost.tokens_per_s_per_gpu:>10,.1f} {100 * errors[name]:>+6.1f}%"
              f"  {cost.bottleneck} ({_second(cost)})")
    # the recipe's micro-batch (1) where the table prints 4: reported, not in the summary
    cfg = gpt_oss_config()
    cfg.train.micro_batch_size = 1
    cost = step_cost(cfg, h100, GPT_OSS_ROW["gpus"])
    tps = float(GPT_OSS_ROW["tps"])
    print(f"{'  (the recipe: micro-batch 1)':>34} {GPT_OSS_ROW['gpus']:>5} {tps:>10,.1f} "
          f"{cost.tokens_per_s_per_gpu:>10,.1f} {100 * (cost.tokens_per_s_per_gpu - tps) / tps:>+6.1f}%"
          f"  {cost.bottleneck} ({_second(cost)})")
    return errors


def _summary(errors: list[float]) -> str:
    return (f"mean {100 * sum(errors) / len(errors):+.1f}%, mean |error| "
            f"{100 * sum(abs(e) for e in errors) / len(errors):.1f}%, max |error| {100 * max(map(abs, errors)):.1f}%")


def _second(cost) -> str:
    return sorted(cost.terms, key=cost.terms.get)[-2]


def megatron_rows(models: dict) -> dict:
    """Print every Megatron-LM row's predicted MFU and error under each cost model in `models`
    (label -> the cluster of Megatron's rows); returns label -> the relative errors."""
    labels = list(models)
    print(f"{'model':>6} {'tp':>3} {'pp':>3} {'dp':>3} {'GPUs':>5} {'batch':>5} {'pub MFU':>8} "
          + " ".join(f"{label + ' MFU':>14} {'error':>7}" for label in labels) + "  bottleneck (2nd), last model")
    errors: dict = {label: [] for label in labels}
    for name, heads, hidden, layers, tp, pp, dp, gpus, batch, _, mfu in MEGATRON_H100:
        cfg = row_config(heads, hidden, layers, tp, pp, dp, batch)
        cells = []
        for label, cluster in models.items():
            cost = step_cost(cfg, cluster, tp * pp * dp)
            errors[label].append((cost.mfu - mfu) / mfu)
            cells.append(f"{100 * cost.mfu:>13.1f}% {100 * errors[label][-1]:>+6.1f}%")
        print(f"{name:>6} {tp:>3} {pp:>3} {dp:>3} {gpus:>5} {batch:>5} {100 * mfu:>7.1f}% " + " ".join(cells)
              + f"  {cost.bottleneck} ({_second(cost)})")
    for label in labels:
        print(f"  {label}: {_summary(errors[label])}")
    return errors


def torchtitan_rows(models: dict) -> dict:
    """Print predicted against torchtitan's TPS/GPU under each cost model in `models` (label -> the
    cluster of torchtitan's rows); returns label -> errors."""
    labels = list(models)
    print("\nvs torchtitan's Llama 3.1 8B FSDP rows (docs/performance.md Tables 1 and 3; bf16, 500 W H100s)"
          "\ntorchtitan rows: eager (compiled: false) or torch.compile as published, hbm 2.4 TB/s, no tp, "
          "FlashAttention-2's causal curve, "
          "selective op recompute (cluster.recompute_ops); before: the SXM's peak, after: the NVL's (footnote 2)")
    print(f"{'GPUs':>5} {'batch':>5} {'compile':>7} {'pub TPS/GPU':>11} "
          + " ".join(f"{label + ' TPS':>14} {'error':>7}" for label in labels) + "  bottleneck (2nd), last model")
    errors: dict = {label: [] for label in labels}
    for gpus, batch, tps, compiled in TORCHTITAN_8B:
        cells = []
        for label, cluster in models.items():  # torch.compile fuses the block's elementwise ops (compiled: true)
            cost = step_cost(torchtitan_config(gpus, batch), dataclasses.replace(cluster, compiled=compiled), gpus)
            errors[label].append((cost.tokens_per_s_per_gpu - tps) / tps)
            cells.append(f"{cost.tokens_per_s_per_gpu:>14,.0f} {100 * errors[label][-1]:>+6.1f}%")
        print(f"{gpus:>5} {batch:>5} {'yes' if compiled else 'no':>7} {tps:>11,} " + " ".join(cells)
              + f"  {cost.bottleneck} ({_second(cost)})")
    for label in labels:
        print(f"  {label}: {_summary(errors[label])}")
    return errors


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="h100", help="conf/cluster/<name>.yaml")
    ap.add_argument("--matmul-fraction", type=float, default=None, help="override cluster.matmul_fraction")
    ap.add_argument("--megatron-attention", choices=("cudnn", "fa2"), default="cudnn",
                    help="the attention kernel of Megatron's rows after (fa2: the preset's FlashAttention-2 curve)")
    args = ap.parse_args(argv)
    cluster = load_cluster(args.cluster)
    if args.matmul_fraction is not None:
        cluster.matmul_fraction = args.matmul_fraction
    # Megatron's rows: its fused kernels, tp communication overlapped (README: "fine-grained overlapping
    # of DP, TP and PP communication"); torchtitan's: eager PyTorch on Grand Teton's 2.4 TB/s HBM2e
    megatron = dataclasses.replace(cluster, compiled=True, tp_overlap=True)
    titan = dataclasses.replace(cluster, compiled=False, tp_overlap=False, hbm_tbps=GRAND_TETON_HBM_TBPS)
    kernel = CUDNN_ATTENTION if args.megatron_attention == "cudnn" else {}
    print(f"megaft cost model on cluster={args.cluster} (matmul_fraction {cluster.matmul_fraction:g}, GEMM curve: "
          f"ceiling {cluster.gemm_ceiling:g}, {cluster.gemm_sms} SMs, {cluster.gemm_tile_m}x{cluster.gemm_tile_n} "
          f"tiles; hbm_fraction {cluster.hbm_fraction:g}, kernel gap {cluster.kernel_gap_us:g} us, eager op "
          f"{cluster.eager_op_us:g} us) vs Megatron-LM's published H100 table (README, images/model_table.png)")
    print(f"Megatron rows: compiled (fused kernels), tp_overlap on, the attention core by "
          f"{args.megatron_attention}'s causal curve; after: dp_overlap on (--overlap-grad-reduce "
          f"--overlap-param-gather)")
    megatron = dataclasses.replace(megatron, **kernel)
    megatron = megatron_rows({"before": megatron, "after": dataclasses.replace(megatron, dp_overlap=True)})
    # torchtitan's rows: its selective "op" policy as torchtitan runs it (cluster.recompute_ops), the 500 W part
    # at the two ends of its footnote's peak: the SXM's (before) and the NVL's (after)
    titan = dataclasses.replace(titan, recompute_ops=True)
    titan = torchtitan_rows({label: dataclasses.replace(titan, peak_tflops_bf16=peak)
                             for label, peak in zip(("before", "after"), GRAND_TETON_PEAK_BOUNDS)})
    # the other sources in their framework's mode: Megatron-DeepSpeed and Megatron-Bridge run fused kernels
    # BLOOM: Megatron-DeepSpeed's fused kernels, its tp all-reduces in line (no overlap), Jean Zay's Omni-Path
    a100 = load_cluster("a100")
    other = other_rows(dataclasses.replace(a100, compiled=True, tp_overlap=False, ib_gbps=JEAN_ZAY_OPA_GBPS),
                       dataclasses.replace(cluster, compiled=True, tp_overlap=True))
    print(f"  other sources: {_summary(list(other.values()))}")
    models = ("before", "after")
    print("\nMegatron-LM and torchtitan rows together:")
    for label in models:
        print(f"  {label}: {_summary(megatron[label] + titan[label])}")


if __name__ == "__main__":
    main()
