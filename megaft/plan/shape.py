"""The config every layout is applied to: the user's settings with the model's shapes resolved.

Shared by megaft-plan (megaft.plan.app) and the elastic re-plan of megaft-train
(megaft.plan.replan); it imports no Hydra app, so megaft.train may use it.
"""
from __future__ import annotations

import dataclasses
import os

from megaft.config import Config
from megaft.config.cluster import PRECISIONS, ClusterConfig, check_plan
from megaft.config.data import DataConfig
from megaft.data.build import build_tokenizer
from megaft.models.checks import check_model
from megaft.models.vision.checks import TRAINED, multimodal_kind
from megaft.perf.hardware import cluster_hbm_tbps, cluster_peak_tflops, with_device_facts
from megaft.plan.calibrate import calibrate
from megaft.plan.measured import apply_measured
from megaft.validation import check_settings


def check_cluster(cfg: ClusterConfig, precision: str) -> list[str]:
    """Problems of a cluster for planning at `precision`, each with its fix."""
    if cfg.gpus_per_node < 1:
        return [f"cluster={cfg.name} has gpus_per_node={cfg.gpus_per_node}; fix: pick a preset, e.g. "
                "cluster=h100 (conf/cluster/), or set cluster.gpus_per_node"]
    problems = []
    if cfg.nodes < 1:
        problems.append(f"cluster.nodes={cfg.nodes} must be >= 1; fix: e.g. cluster.nodes=8")
    if precision in PRECISIONS and cluster_peak_tflops(cfg, precision) <= 0:
        problems.append(f"cluster.peak_tflops_{precision}={cluster_peak_tflops(cfg, precision)} must be > 0; fix: the "
                        "device's dense peak from its datasheet")
    for name in ("matmul_fraction", "comm_fraction"):
        if not 0 < getattr(cfg, name) <= 1:
            problems.append(f"cluster.{name}={getattr(cfg, name)} must be in (0, 1]; fix: e.g. 0.7")
    if cfg.gemm_sms > 0 and not (0 < cfg.gemm_ceiling <= 1 and cfg.gemm_tile_m >= 1 and cfg.gemm_tile_n >= 1):
        problems.append(f"cluster.gemm_ceiling={cfg.gemm_ceiling} must be in (0, 1] and cluster.gemm_tile_m/n >= 1 "
                        "with a GEMM curve (gemm_sms > 0); fix: the device's measured values, or gemm_sms=0")
    if not 0 <= cfg.hbm_fraction <= 1 or cfg.kernel_gap_us < 0 or cfg.eager_op_us < 0:
        problems.append(f"cluster.hbm_fraction={cfg.hbm_fraction} must be in [0, 1] (0: elementwise kernels not "
                        f"priced), cluster.kernel_gap_us={cfg.kernel_gap_us} and cluster.eager_op_us="
                        f"{cfg.eager_op_us} >= 0; fix: the device's measured values")
    curve = (cfg.attention_seq, cfg.attention_fwd_tflops, cfg.attention_fwd_causal_tflops, cfg.attention_bwd_tflops)
    if any(curve) and not (len(set(map(len, curve))) == 1 and all(x > 0 for c in curve for x in c)
                           and list(cfg.attention_seq) == sorted(set(cfg.attention_seq))):
        problems.append(f"cluster.attention_seq={list(cfg.attention_seq)} and the attention_*_tflops lists must be "
                        "as long, positive, the lengths increasing; fix: the kernel's measured rates, or all empty")
    for name in ("compute_scale", "comm_scale", "optimizer_scale"):
        if getattr(cfg, name) <= 0:
            problems.append(f"cluster.{name}={getattr(cfg, name)} must be > 0 (1 = uncalibrated); fix: "
                            "plan.calibrate=RUN_DIR derives it from a finished run")
    if cfg.step_overhead_s < 0:
        problems.append(f"cluster.step_overhead_s={cfg.step_overhead_s} must be >= 0; fix: 0, or "
                        "plan.calibrate=RUN_DIR")
    if cluster_hbm_tbps(cfg) <= 0:
        problems.append(f"cluster.hbm_tbps={cluster_hbm_tbps(cfg)} must be > 0; fix: the datasheet's value")
    for name in ("nvlink_gbps", "ib_gbps", "pcie_gbps", "host_memory_gbps"):
        if getattr(cfg, name) <= 0:
            problems.append(f"cluster.{name}={getattr(cfg, name)} must be > 0; fix: the datasheet's value")
    if not cfg.gpu_type and cfg.hbm_gb <= 0:
        problems.append("cluster.gpu_type is empty and cluster.hbm_gb is 0: no memory budget; fix: set one")
    return problems


def planning_model(cfg: Config):
    """(ModelConfig with every shape field filled and no init_from, problems): the
    architecture of model.init_from's config.json (no weights needed), else the preset's
    with the tokenizer's vocabulary when vocab_size is 0."""
    m = cfg.model
    if m.init_from:
        from megaft.models.hf.config import hf_model_config

        if not os.path.isfile(os.path.join(m.init_from, "config.json")):
            return m, [f"model.init_from={m.init_from!r} has no config.json; fix: point it at a Hugging Face "
                       "Llama checkpoint directory (config.json is all megaft-plan reads)"]
        try:  # a vision-language checkpoint: its language model (the tower: megaft.plan.vision)
            if multimodal_kind(m.init_from) in TRAINED:
                from megaft.models.vision.family import vision_config_of  # imports torch: not for a text model

                m = vision_config_of(m.init_from, base=m).text
            else:
                m = hf_model_config(m.init_from, base=m)
        except (OSError, ValueError) as exc:
            return m, [str(exc)]
    elif m.vocab_size == 0:
        try:
            m = dataclasses.replace(m, vocab_size=build_tokenizer(cfg.data, init_from=None).get_vocab_size())
        except (OSError, ValueError) as exc:
            return m, [f"model.vocab_size=0 and the tokenizer cannot be read ({exc}); fix: set model.vocab_size"]
    return dataclasses.replace(m, init_from=None), []


def planning_config(cfg: Config) -> tuple[Config, list[str]]:
    """(the config every layout is applied to, problems that no layout can fix).

    It keeps the user's settings but the model's shapes are resolved (no init_from), the
    cluster's links are the measured ones with cluster.measured (megaft.plan.measured), its factors
    those of plan.calibrate's run (megaft.plan.calibrate), and
    the data is only its sequence length and data.path (never read: the data files are
    megaft-train's to check; megaft-train refuses parallel.ep > 1 on the generated task, a
    run without data.path, and so does every layout the planner checks).
    """
    cluster = with_device_facts(cfg.cluster)  # the table's peaks and HBM where the preset has none
    problems = check_cluster(cluster, str(cfg.precision))
    if not problems:  # cluster.measured: megaft-commbench's links replace the datasheet's
        cluster, _, problems = apply_measured(cluster)
    problems += check_plan(cfg.plan)
    model, model_problems = planning_model(cfg)
    problems += model_problems
    if not problems and cfg.plan.calibrate:  # a finished run's phase times set the cluster's factors
        cluster, _, calibration_problems = calibrate(dataclasses.replace(cfg, model=model), cluster)
        problems += calibration_problems
    data = DataConfig(seq_len=cfg.data.seq_len)
    shaped = dataclasses.replace(cfg, cluster=cluster, model=model, data=dataclasses.replace(data, path=cfg.data.path))
    if not model_problems:  # the layout-free half: a single rank, the whole batch at once (no file read)
        single = dataclasses.replace(
            shaped, data=data, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, dp=1, cp=1, vpp=1, ep=1,
                                                            zero=0, pp_layers=None),
            train=dataclasses.replace(cfg.train, micro_batch_size=cfg.train.global_batch_size))
        problems += check_settings(single, 1) + check_model(model, 1)
        if cfg.data.seq_len > model.max_seq_len:
            problems.append(f"data.seq_len={cfg.data.seq_len} > model.max_seq_len={model.max_seq_len}; "
                            f"fix: model.max_seq_len={cfg.data.seq_len} (megaft-train needs it too)")
    return shaped, problems
