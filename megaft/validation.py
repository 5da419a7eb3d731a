"""validate(): every problem of a run's config before any rank starts or any job is queued.

`validate` = `check_settings` (the values as written: each section's pure check in
megaft.config, and the checks that read the files and the environment: the data, the
tokenizer, the chat template, the kernels and fused optimizer on the run's device) ->
`resolve` (the one step with an effect: the HF architecture and the tokenizer's vocabulary
filled in) -> `check_resolved` (the architecture against the layout, then the memory
estimate of megaft.perf). It sits above the sections it checks, so megaft.config itself
imports nothing of megaft's packages.
"""
from __future__ import annotations

import math
import os

from megaft.config import Config, Device, Precision
from megaft.config.data import data_sources
from megaft.config.distill import check_distill, check_generation_run
from megaft.config.keep import exports_hf, exports_merged
from megaft.config.launcher import check_launcher
from megaft.config.lora import check_lora, check_lora_model, check_lora_moe
from megaft.config.moe import check_moe
from megaft.config.optim import check_master_weights, check_optim
from megaft.config.parallel import check_parallel, resolve_dp
from megaft.config.pref import check_pref, check_pref_run, reads_pairs
from megaft.config.reward import check_reward, check_reward_run, is_reward
from megaft.config.rl import check_rl, check_rl_run
from megaft.config.train import accumulation_steps, check_train
from megaft.config.wandb import check_logger
from megaft.data.build import build_tokenizer
from megaft.data.checks import check_data
from megaft.data.errors import DataError
from megaft.data.prompts import check_samples
from megaft.distill.checks import check_prompts, check_teacher, check_top_k
from megaft.eval.checks import check_then_eval
from megaft.kernels.checks import check_kernels
from megaft.models.checks import check_model
from megaft.models.vision.checks import check_vision_run, trains_images
from megaft.optim.checks import check_fused, check_muon_layout
from megaft.pref.checks import check_reference, reference_dir_problems


def resolve(cfg: Config) -> Config:
    """Fill the fields that come from files: the HF architecture of model.init_from and
    the vocabulary size of the tokenizer. Call after the files were validated."""
    if cfg.model.init_from:
        from megaft.models.hf.config import hf_model_config

        # Shape fields from config.json; dropout, init and padding stay as configured.
        if trains_images(cfg):  # a vision-language model: the language model's (the tower's: its own config)
            from megaft.models.vision.family import vision_config_of

            cfg.model = vision_config_of(cfg.model.init_from, base=cfg.model).text
        else:
            cfg.model = hf_model_config(cfg.model.init_from, base=cfg.model)
    elif cfg.model.vocab_size == 0:
        cfg.model.vocab_size = build_tokenizer(cfg.data, init_from=None).get_vocab_size()
    if is_reward(cfg.train.objective):  # a reward model: the scalar head instead of the LM head
        cfg.model.score_head = True
        if cfg.model.extra.get("pad_token_id") is None:  # the export's class searches for it (megaft.reward)
            from megaft.data.tokenizer import special_ids

            tok = build_tokenizer(cfg.data, init_from=cfg.model.init_from)
            cfg.model.extra = {**cfg.model.extra, "pad_token_id": special_ids(tok, cfg.model.extra.get(
                "eos_token_id"))[1]}
    return cfg


def _model_file_problems(init_from: str) -> list[str]:
    if not os.path.isdir(init_from):
        return [f"model.init_from={init_from!r} is not a directory; fix: point it at a Hugging Face "
                "checkpoint directory of a supported family, megaft.models.arch.SPECS (config.json, "
                "*.safetensors, tokenizer.json)"]
    problems = []
    if not os.path.isfile(os.path.join(init_from, "config.json")):
        problems.append(f"{os.path.join(init_from, 'config.json')} is missing; fix: save the model with "
                        "save_pretrained or copy its config.json")
    if not any(os.path.isfile(os.path.join(init_from, f))
               for f in ("model.safetensors", "model.safetensors.index.json")):
        problems.append(f"{init_from} has neither model.safetensors nor model.safetensors.index.json; "
                        "fix: save with safe_serialization=True")
    return problems


def check_local_launch(cfg: Config) -> list[str]:
    """Problems of starting launcher.nproc ranks on this machine."""
    if cfg.launcher.nproc < 1:
        return [f"launcher.nproc={cfg.launcher.nproc} must be >= 1"]
    if cfg.device == "cpu":  # gloo ranks: any number (and no torch import in the launcher)
        return []
    import torch

    gpus = torch.cuda.device_count()
    if cfg.device != "cpu" and gpus and cfg.launcher.nproc > gpus:
        return [f"launcher.nproc={cfg.launcher.nproc} ranks but {gpus} GPU(s): NCCL needs one GPU per rank; "
                f"fix: launcher.nproc<={gpus} (with matching parallel.tp/dp) or device=cpu"]
    return []


def _pipeline_problems(cfg: Config, world_size: int) -> list[str]:
    from megaft.pipeline.partition import check_pipeline

    par = cfg.parallel
    if par.pp < 1:
        return []  # reported by check_parallel
    dp = resolve_dp(par, world_size)
    return check_pipeline(par.pp, par.vpp, par.schedule, par.pp_layers, cfg.model.n_layers,
                          max(accumulation_steps(cfg.train, dp), 1))


def _context_problems(cfg: Config) -> list[str]:
    """parallel.cp against the sequence: 2·cp equal chunks, each a multiple of tp under
    sequence parallel (the ring's chunks are never padded)."""
    par, seq = cfg.parallel, cfg.data.seq_len
    if par.cp <= 1 or par.tp < 1:
        return []
    if seq % (2 * par.cp):
        return [f"parallel.cp={par.cp} cuts data.seq_len={seq} into 2*cp={2 * par.cp} equal chunks, which it does "
                f"not divide; fix: a data.seq_len that is a multiple of {2 * par.cp}"]
    if par.sequence_parallel and (seq // par.cp) % par.tp:
        return [f"parallel.cp={par.cp} with sequence parallel gives each rank data.seq_len/cp={seq // par.cp} "
                f"tokens, which parallel.tp={par.tp} does not divide; fix: a data.seq_len that is a multiple "
                f"of {2 * par.cp * par.tp // math.gcd(2, par.tp)}"]
    return []


def check_settings(cfg: Config, world_size: int) -> list[str]:
    """Problems of the values as written, for a world of `world_size` ranks: pure (reads
    the data and tokenizer files it names, changes nothing)."""
    return check_layout_settings(cfg, world_size) + check_fixed_settings(cfg)


def check_layout_settings(cfg: Config, world_size: int) -> list[str]:
    """The settings' problems that depend on the layout (parallel degrees, ZeRO, micro-batch):
    what megaft-plan checks for each layout after checking the rest once."""
    par = cfg.parallel
    problems = check_parallel(par, world_size)
    problems += _context_problems(cfg)
    problems += check_train(cfg.train, resolve_dp(par, world_size))
    problems += check_lora(cfg.lora, precision=cfg.precision, zero=par.zero, export_hf=exports_hf(cfg),
                           fused_linear_cross_entropy=cfg.kernels.fused_linear_cross_entropy)
    problems += check_muon_layout(cfg)
    if par.zero in (2, 3) and par.pp > 1 and cfg.model.tie_embeddings:
        problems.append(f"parallel.zero={par.zero} with parallel.pp>1 and model.tie_embeddings: the tied "
                        "copies' grads are summed before the dp reduction, which zero>=2 does not keep; "
                        "fix: parallel.zero=1")
    if par.offload == "cpu" and cfg.optim.fused not in ("auto", "cpu"):  # the update runs on host tensors
        problems.append(f"parallel.offload=cpu updates on the host, where optim.fused={cfg.optim.fused} cannot run; "
                        "fix: optim.fused=auto or cpu (or parallel.offload=none)")
    if par.zero == 3:  # layers are gathered by module hooks; these paths read whole params directly
        for on, name in ((exports_hf(cfg), "train.export_hf"),
                         (cfg.kernels.fused_linear_cross_entropy, "kernels.fused_linear_cross_entropy")):
            if on:
                problems.append(f"parallel.zero=3 does not support {name} yet; fix: parallel.zero=2 or turn it off")
    return problems


def check_fixed_settings(cfg: Config) -> list[str]:
    """The settings' problems that no layout changes: optimizer, data (it parses every
    line of the JSONL files), launcher, precision, device and kernels."""
    problems = check_optim(cfg.optim) + check_fused(cfg.optim, device=cfg.device)
    problems += check_master_weights(cfg.optim, precision=cfg.precision)
    pairs = None
    if reads_pairs(cfg.train.objective):
        from megaft.pref.data import pair_source_problems as pairs
    elif trains_images(cfg):  # conversations with image parts (megaft.data.image_chat)
        from megaft.data.image_chat import image_source_problems as pairs
    problems += check_data(cfg.data, init_from=cfg.model.init_from, pairs=pairs)
    problems += check_pref(cfg.pref, cfg.train.objective)
    problems += check_reward(cfg.reward, cfg.train.objective)
    problems += check_rl(cfg.rl, cfg.train.objective, global_batch_size=cfg.train.global_batch_size,
                         micro_batch_size=cfg.train.micro_batch_size)
    problems += check_distill(cfg.distill, cfg.train.objective)
    problems += check_launcher(cfg.launcher)
    problems += check_samples(cfg.sample, cfg.train.sample_every, lambda: _chat_template(cfg))
    problems += check_logger(cfg.logger, cfg.wandb)
    problems += check_then_eval(cfg.eval, then_eval=cfg.train.then_eval, export_hf=exports_hf(cfg),
                                lora_rank=cfg.lora.rank, export_merged=exports_merged(cfg),
                                save_every=cfg.train.save_every or int(cfg.train.save_final))  # a checkpoint to export
    if cfg.precision not in set(Precision):  # a Config built in Python: Hydra checked the YAML/CLI ones
        problems.append(f"precision={cfg.precision!r} is unknown; fix: fp32, bf16 or fp16")
    if cfg.device not in set(Device):
        problems.append(f"device={cfg.device!r} is unknown; fix: auto, cpu or cuda")
    else:
        problems += check_kernels(cfg.kernels, cfg.device)
    return problems


def _chat_template(cfg: Config):
    """The run's chat template (None: none), for the sample prompts' conversations."""
    from megaft.data.templates import load_chat_template, tokenizer_dir_of

    return load_chat_template(cfg.data.chat_template, tokenizer_dir_of(cfg.data.tokenizer, cfg.model.init_from))


def _overlap_problems(cfg: Config) -> list[str]:
    """parallel.tp_overlap=ring against the model and kernels: its rings run the dense GQA/MLP
    blocks' GEMMs with torch (megaft.parallel.tensor.overlap)."""
    if cfg.parallel.tp_overlap != "ring" or cfg.parallel.tp == 1:
        return []
    m, problems = cfg.model, []
    linear = cfg.kernels.for_op("linear")
    if linear in ("triton", "cuda"):
        problems.append(f"parallel.tp_overlap=ring runs the parallel linears' GEMMs chunk by chunk with torch, not "
                        f"the fused kernels.linear={linear} (bias/residual epilogues, wgrad into the main grad); fix: "
                        "kernels.linear=torch (or auto), or parallel.tp_overlap=none")
    for on, what in ((m.mla, "multi-head latent attention (model.mla)"),
                     (m.n_experts > 0, "mixture-of-experts layers (model.n_experts)"),
                     (trains_images(cfg), "vision-language models")):
        if on:
            problems.append(f"parallel.tp_overlap=ring covers grouped-query attention and the dense MLP, not {what}; "
                            "fix: parallel.tp_overlap=none")
    return problems


def _softcap_problems(cfg: Config) -> list[str]:
    """Soft-capping (Gemma 2) runs in the explicit attention and on whole logits only."""
    m, problems = cfg.model, []
    if m.attn_softcap is not None and cfg.parallel.cp > 1:
        problems.append(f"parallel.cp={cfg.parallel.cp} with soft-capped attention (model.attn_softcap="
                        f"{m.attn_softcap}, Gemma 2) is not supported: the ring has no cap; fix: parallel.cp=1")
    if m.final_softcap is not None and cfg.kernels.fused_linear_cross_entropy:
        problems.append(f"kernels.fused_linear_cross_entropy never builds the logits that model.final_softcap="
                        f"{m.final_softcap} caps; fix: kernels.fused_linear_cross_entropy=false")
    return problems


def _expert_problems(cfg: Config) -> list[str]:
    """parallel.ep against the model: experts to split, evenly."""
    ep, experts = cfg.parallel.ep, cfg.model.n_experts
    if ep == 1:
        return []
    if experts == 0:
        return [f"parallel.ep={ep} splits the experts of a mixture of experts, and model.arch={cfg.model.arch} is "
                "dense; fix: parallel.ep=1"]
    problems = []
    if experts % ep:
        problems.append(f"parallel.ep={ep} does not divide model.n_experts={experts}: each ep rank holds "
                        f"n_experts/ep experts; fix: parallel.ep among the common divisors of {experts} and dp*cp")
    if cfg.data.path is None and not cfg.data.sources:  # the generated task's accuracy: uneven generation
        problems.append(f"parallel.ep={ep} cannot evaluate the generated task data.task={cfg.data.task} (its greedy "
                        "generation runs a different number of forwards per dp rank, and every MoE layer exchanges "
                        "tokens across them); fix: train on a file (data.path=...), or parallel.ep=1")
    return problems


def check_resolved(cfg: Config, world_size: int, *, gpu_budget: tuple[int, str] | None = None) -> list[str]:
    """Problems of the architecture and layout once `resolve` filled them in, then of the
    memory estimate when there are none (it needs a consistent config): pure."""
    problems = check_layout(cfg, world_size)
    if not problems:
        from megaft.perf.memory import check_memory

        problems += check_memory(cfg, world_size, gpu_budget)
    return problems


def check_layout(cfg: Config, world_size: int) -> list[str]:
    """check_resolved without the memory estimate."""
    problems = check_model(cfg.model, cfg.parallel.tp)
    problems += check_lora_model(cfg.lora, tie_embeddings=cfg.model.tie_embeddings, kv_heads=cfg.model.kv_heads,
                                 tp=cfg.parallel.tp, mla=cfg.model.mla, q_latent=cfg.model.q_lora_rank is not None)
    problems += check_lora_moe(cfg.lora, n_experts=cfg.model.n_experts,
                               shared_expert=bool(cfg.model.shared_expert_ffn_dim))
    problems += _pipeline_problems(cfg, world_size) + _softcap_problems(cfg) + _expert_problems(cfg)
    problems += _overlap_problems(cfg)
    problems += check_pref_run(cfg.train.objective, has_file=cfg.data.path is not None or bool(cfg.data.sources),
                               packing=cfg.data.packing,
                               n_experts=cfg.model.n_experts, share_prompt=cfg.pref.share_prompt,
                               cp=cfg.parallel.cp, window=cfg.model.sliding_window is not None,
                               capacity=cfg.moe.capacity_factor is not None,
                               global_aux=cfg.moe.aux_scope == "global_batch")
    problems += check_reference(cfg.pref, cfg.train.objective, cfg.model)
    problems += check_reward_run(cfg.train.objective, has_file=cfg.data.path is not None or bool(cfg.data.sources),
                                 packing=cfg.data.packing, n_experts=cfg.model.n_experts,
                                 lora_rank=cfg.lora.rank,
                                 fused_linear_cross_entropy=cfg.kernels.fused_linear_cross_entropy,
                                 sample_every=cfg.train.sample_every, then_eval=cfg.train.then_eval,
                                 eval_pairs=cfg.eval.pairs)
    if cfg.model.score_head and not is_reward(cfg.train.objective):
        problems.append(f"model.score_head=true builds a reward model's scalar head, and train.objective="
                        f"{cfg.train.objective} reads the LM head; fix: model.score_head=false or "
                        "train.objective=reward")
    problems += check_rl_run(cfg.rl, cfg.train.objective, has_data_file=cfg.data.path is not None or
                             bool(cfg.data.sources), n_experts=cfg.model.n_experts, packing=cfg.data.packing,
                             cp=cfg.parallel.cp)
    if cfg.train.objective == "grpo" and cfg.rl.beta > 0 and cfg.rl.reference:
        problems += reference_dir_problems(cfg.rl.reference, "rl.reference", cfg.model)
    if cfg.train.objective == "distill" and cfg.distill.teacher:
        from megaft.data.templates import tokenizer_dir_of

        problems += check_teacher(cfg.distill, cfg.model, cfg.parallel.tp,
                                  tokenizer_dir_of(cfg.data.tokenizer, cfg.model.init_from))
    if cfg.train.objective == "distill" and cfg.distill.top_k is not None:
        problems += check_top_k(cfg.distill.top_k, vocab_size=cfg.model.vocab_size, pp=cfg.parallel.pp,
                                cp=cfg.parallel.cp, packing=cfg.data.packing)
    if cfg.train.objective == "distill":
        problems += check_generation_run(cfg.distill, packing=cfg.data.packing)
        if cfg.distill.generates:
            problems += check_prompts([s.path for s in data_sources(cfg.data)])
    if cfg.train.objective == "distill" and cfg.model.n_experts > 0:
        problems.append("train.objective=distill of a mixture of experts is not built (the router terms are not "
                        "added); fix: a dense student")
    problems += check_moe(cfg.moe, n_experts=cfg.model.n_experts, cp=cfg.parallel.cp, dropout=cfg.model.dropout,
                          correction_bias=cfg.model.router_scoring == "sigmoid")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        problems.append(f"data.seq_len={cfg.data.seq_len} > model.max_seq_len={cfg.model.max_seq_len}; "
                        "fix: lower data.seq_len or raise model.max_seq_len")
    return problems


def validate(cfg: Config, world_size: int, *, gpu_budget: tuple[int, str] | None = None) -> list[str]:
    """All problems of `cfg` for a world of `world_size` ranks (empty when valid): the
    one call before any rank starts or any job is queued.

    Three steps: `check_settings` (the values as written), `resolve` (the one step
    with an effect: it fills `cfg` in place from the HF config.json and the
    tokenizer, when those files are usable), `check_resolved` (architecture, layout,
    memory). `gpu_budget` (bytes per GPU, its source) is the target GPU when the
    caller knows it (a Slurm preset's gpu_type); launcher.gpu_mem_gb still wins
    (megaft.perf.memory.memory_budget).
    """
    problems = check_settings(cfg, world_size)
    if cfg.model.init_from:
        file_problems = _model_file_problems(cfg.model.init_from)
        if file_problems:  # the architecture lives in the missing files
            return problems + file_problems
        vision = check_vision_run(cfg)
        if vision:  # a vision-language checkpoint: what it does not support, named before resolve reads it
            return problems + vision
    else:  # model.freeze names parts only a vision-language checkpoint has
        problems += check_vision_run(cfg)
    if cfg.model.init_from or not any("tokenizer" in p for p in problems):
        try:
            resolve(cfg)
        except (OSError, ValueError) as exc:
            return problems + [str(exc)]
    return problems + check_resolved(cfg, world_size, gpu_budget=gpu_budget) + _rollout_problems(cfg)


def _rollout_problems(cfg: Config) -> list[str]:
    """rl.rollouts parsed whole, or rl.prompts read and encoded, once, with the resolved vocabulary and
    data.seq_len (train.objective=grpo)."""
    rl = cfg.rl
    path, name = (rl.rollouts, "rl.rollouts") if rl.rollouts else (rl.prompts, "rl.prompts")
    if cfg.train.objective != "grpo" or not path:
        return []
    if not os.path.isfile(path):
        return [f"{name}={path} is not a file; fix: the path of a JSONL file of " +
                ("rollouts" if rl.rollouts else '{"prompt": str} or {"messages": [...]} lines') + " (docs/rl.md)"]
    from megaft.rl.rewards import load_reward
    from megaft.rl.rollouts import read_rollouts

    problems = []
    for spec in rl.reward:  # each imports here, before any rank starts
        try:
            load_reward(spec, rl.format_pattern)
        except ValueError as exc:
            problems.append(str(exc))
    try:
        if rl.rollouts:
            read_rollouts(rl.rollouts, rl.num_generations, rl.max_completion_length, cfg.data.seq_len,
                          cfg.model.vocab_size, scored=bool(rl.reward))
        else:
            from megaft.rl.online import fit_problems, prompt_problems, read_rl_prompts

            tok = build_tokenizer(cfg.data, init_from=cfg.model.init_from)
            encoded = read_rl_prompts(path, tok, _chat_template(cfg))
            bad = prompt_problems(encoded, cfg.data.seq_len, cfg.model.vocab_size)
            problems += [f"rl.prompts={path}: {p}; fix: shorter prompts or a longer data.seq_len" for p in bad]
            if encoded and not bad:
                problems += fit_problems(encoded, rl.max_completion_length, cfg.data.seq_len, cfg.model.max_seq_len)
    except DataError as exc:
        problems.append(f"rl.prompts: {exc}")
    except ValueError as exc:
        problems.append(str(exc))
    return problems
