"""The training loop of one rank: micro-batches, reductions, clipping, AdamW, eval.

The global batch of each step is a pure function of (data seed, step), identical
on every rank; a rank takes its dp slice and splits it into micro-batches. Each
micro-batch's summed token loss is divided by the target count of the WHOLE
global batch, so the accumulated, dp-summed gradient is exactly the gradient of
the token-weighted mean loss for any (tp, dp, micro-batch) split.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Optional

import torch
from tqdm import tqdm

from megaft import checkpoint
from megaft.checkpoint.reshard import param_index
from megaft.config import Config
from megaft.data import (
    PackedStream, build_tokenizer, count_targets, encode_examples, eval_batches, load_examples, special_ids,
)
from megaft.kernels.autotune import decide_kernels
from megaft.launch.preempt import NONE, REQUEUE, PreemptFlag, StepBoundary
from megaft.layers.shard import full_shape
from megaft.models.llama import Llama
from megaft.optim import LossScaler, build_optimizer, clip_grad_norm_, lr_at
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.pipeline.actions import ActionKind
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pipeline.stage import StageModel, build_embedding_group, sync_tied_grads
from megaft.training.config import accumulation_steps
from megaft.training.evaluate import eval_accuracy, eval_loss, pipeline_eval_loss
from megaft.training.flops import device_peak_tflops, flops_per_token, mfu
from megaft.training.metrics import MetricsLog, use_tensorboard, write_summary
from megaft.training.phases import PHASE_KEYS, PhaseTimer


def choose_kernels(cfg: Config, grid: ParallelGrid):
    """(KernelsConfig, record): kernels.backend=auto on CUDA set to the backends measured
    fastest (rank 0 decides for all ranks), and each op's backend and its source for
    summary.json (megaft.kernels.autotune.decide_kernels)."""
    return decide_kernels(cfg.kernels, cfg.model, tp=grid.tp_size, batch=cfg.train.micro_batch_size,
                          seq=cfg.data.seq_len, precision=cfg.precision, device=grid.device, rank=grid.rank,
                          master_weights=cfg.optim.master_weights)


def build_model(cfg: Config, grid: ParallelGrid, kernels=None) -> Llama | StageModel:
    """The sharded model on this rank's device: HF weights or a tp-independent init.
    Under pp > 1 it is this rank's pipeline stages (`StageModel`, same parameter names).
    `kernels`: the decided KernelsConfig (default: choose_kernels)."""
    par = cfg.parallel
    if kernels is None:
        kernels = choose_kernels(cfg, grid)[0]
    if grid.pp_size > 1:
        model = StageModel(cfg.model, pp=grid.pp_size, pp_rank=grid.pp_rank, vpp=par.vpp, pp_layers=par.pp_layers,
                           group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels)
    else:
        model = Llama(cfg.model, group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels)
    if cfg.model.init_from:
        from megaft.models.hf import load_hf_weights

        load_hf_weights(model, cfg.model.init_from, tp_rank=grid.tp_rank, tp_size=grid.tp_size,
                        strict=grid.pp_size == 1)
    else:
        from megaft.models.init import init_params

        init_params(model, cfg.model, seed=cfg.train.seed, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    return model.to(grid.device)


class Trainer:
    """Owns the model, optimizer and data of one rank for one run."""

    def __init__(self, cfg: Config, grid: ParallelGrid, run_dir: str):
        self.cfg, self.grid, self.run_dir = cfg, grid, run_dir
        self.is_writer = grid.rank == 0
        # Dropout differs across dp replicas but matches across tp ranks (replicated activations).
        torch.manual_seed(cfg.train.seed + 1000 * grid.dp_rank)
        self.tok = build_tokenizer(cfg.data, init_from=cfg.model.init_from)
        self.eos_id, pad_id = special_ids(self.tok, cfg.model.extra.get("eos_token_id"))
        examples = load_examples(cfg.data)
        self.task = examples.task
        self.stream = PackedStream(encode_examples(self.tok, examples.train, self.eos_id), cfg.data.seq_len,
                                   cfg.data.seed)
        self.eval_batches = eval_batches(encode_examples(self.tok, examples.eval, self.eos_id),
                                         cfg.train.eval_batch_size, pad_id, max_len=cfg.model.max_seq_len)
        kernels, self.kernel_choices = choose_kernels(cfg, grid)
        self.model = build_model(cfg, grid, kernels)
        # Flat buffers, optimizer (ZeRO stage) and the bucketed dp reduction (megaft.optim.zero).
        norm_params = self.model.norm_params() if grid.pp_size > 1 else None
        self.flat, self.optimizer, self.reducer = build_optimizer(
            self.model, cfg.optim, zero=cfg.parallel.zero, bucket_mb=cfg.parallel.bucket_mb, grid=grid,
            norm_params=norm_params, compression=cfg.parallel, offload=cfg.parallel.offload)
        self.scaler: Optional[LossScaler] = None
        if cfg.precision == "fp16":
            self.scaler = LossScaler(init_scale=cfg.optim.loss_scale, growth_interval=cfg.optim.loss_scale_window)
        self.optimizer.scaler = self.scaler  # saved in checkpoints with the optimizer state
        self.pipeline: Optional[PipelineRuntime] = None
        if grid.pp_size > 1:
            self.pipeline = PipelineRuntime(self.model, grid, cfg.parallel.schedule,
                                            accumulation_steps(cfg.train, grid.dp_size), cfg.parallel.vpp)
            self.embedding_group = build_embedding_group(grid) if cfg.model.tie_embeddings else None
        self.metrics = MetricsLog(run_dir, enabled=self.is_writer,
                                  tensorboard=self.is_writer and use_tensorboard(cfg.train.tensorboard))
        self.phases = PhaseTimer(grid.device, enabled=cfg.train.log_phases)
        if self.pipeline is not None:
            self.phases.wrap_pipeline(self.pipeline._compute, ActionKind.F, ActionKind.B)
        # MFU (megaft.training.flops): None on CPU unless train.peak_tflops is set.
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_tflops = device_peak_tflops(grid.device, cfg.precision, cfg.train.peak_tflops)
        self.checkpoint_dir = os.path.join(run_dir, "checkpoints")
        self.writer = checkpoint.CheckpointWriter(self.checkpoint_dir, grid, keep_last=cfg.train.keep_last,
                                                  async_save=cfg.train.async_save)
        self.boundary = StepBoundary(grid.world_size, grid.device)

    def autocast(self):
        if self.cfg.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
            return torch.autocast(self.grid.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> dict[str, float]:
        cfg, grid = self.cfg.train, self.grid
        inputs, labels = self.stream.global_batch(step, cfg.global_batch_size)
        n_targets = max(count_targets(labels), 1)
        share = cfg.global_batch_size // grid.dp_size
        rows = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)
        micro_in, micro_lab = inputs[rows].split(cfg.micro_batch_size), labels[rows].split(cfg.micro_batch_size)
        # fp16 backpropagates loss * scale: dividing by n_targets / scale keeps one code path.
        divisor = n_targets / self.scaler.scale if self.scaler else n_targets
        phase = self.phases.phase
        self.phases.start_step()
        if self.pipeline is not None:  # dp reduction after the schedule (reducer not armed)
            loss_sum = self.pipeline.train_step(list(micro_in), list(micro_lab), divisor, self.autocast)
            self.phases.add("comm", self.pipeline.wait_s)
            with phase("comm"):
                sync_tied_grads(self.model, self.embedding_group)
                all_reduce(loss_sum, grid.pp_group)  # the last stage's loss, on every pp rank
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=grid.device)
            for i, (mb_in, mb_lab) in enumerate(zip(micro_in, micro_lab)):
                if i == len(micro_in) - 1:
                    self.reducer.arm()  # buckets reduce during the last backward only
                with phase("forward"), self.autocast():
                    loss = self.model.loss_sum(mb_in.to(grid.device), mb_lab.to(grid.device))
                with phase("backward"):
                    (loss / divisor).backward()
                loss_sum += loss.detach().double()
        with phase("comm"):
            self.reducer.finish()  # every bucket reduced over dp before any gradient is read
        opt = self.optimizer
        self.phases.begin("optimizer")  # clip + step (+ the grad-norm all-reduce)
        opt.sync_sequence_parallel(grid.tp_group)  # a tp sum: commutes with the dp sum
        finite = self.scaler.unscale_(opt.grads) if self.scaler else True
        norm = opt.grad_norm(grid.tp_group, grid.pp_group)
        lr = lr_at(step, self.cfg.optim, cfg.max_steps)
        if finite:  # fp16 overflow on any rank: every rank skips the update
            clip_grad_norm_(opt.grads, norm, self.cfg.optim.clip_grad)
            opt.step(lr)
        if self.scaler:
            self.scaler.update(finite)
        opt.zero_grad()
        self.phases.end("optimizer")
        with phase("comm"):
            all_reduce(loss_sum, grid.dp_group)
        out = {"loss": (loss_sum / n_targets).item(), "lr": lr, "grad_norm": norm.item(),
               "tokens": int(inputs.numel())}
        if self.scaler:
            out.update(loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped)
        out.update(self.phases.result())
        return out

    def evaluate(self, step: int) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step}
        # ZeRO-3: whole params while evaluating (dp ranks run unequal numbers of forwards)
        gatherer = getattr(self.optimizer, "gatherer", None)
        if gatherer is not None:
            gatherer.acquire_all()
        if self.pipeline is not None:
            loss = pipeline_eval_loss(self.pipeline, self.eval_batches, self.grid, self.autocast)
        else:
            loss = eval_loss(self.model, self.eval_batches, self.grid, self.autocast)
        if loss is not None:
            record["eval_loss"] = loss
        if self.task is not None:  # under pp, greedy generation runs through the stages
            record["eval_accuracy"] = eval_accuracy(self.pipeline or self.model, self.task, self.tok, self.eos_id,
                                                    self.grid, self.autocast)
        if gatherer is not None:
            gatherer.release_all()
        self.metrics.write(**record)
        return record

    def resume(self) -> int:
        """Load the newest complete checkpoint when train.resume is on; the step to continue from."""
        if not self.cfg.train.resume:
            return 0
        step = checkpoint.load_latest(self.checkpoint_dir, self.flat, self.optimizer, self.grid, model=self.model,
                                      reducer=self.reducer)  # + PowerSGD state (megaft.checkpoint.state)
        if step is None:
            return 0
        if self.is_writer:
            checkpoint.trim_metrics(self.metrics.path, step)
        return step

    def maybe_save(self, done: int, end: int, *, force: bool = False) -> None:
        """Checkpoint after `done` steps every train.save_every steps, when the run stops at `end`,
        and always when `force` (a preemption signal: losing the work would be worse)."""
        every = self.cfg.train.save_every
        if force or (every and (done % every == 0 or done == end)):
            state = checkpoint.capture(self.flat, self.optimizer, self.grid, done, reducer=self.reducer)
            state["index"] = param_index(self.model, self.flat)  # names/offsets/splits: resharding on load
            self.writer.save(done, state)

    def step_boundary(self, done: int, end: int, flag: PreemptFlag) -> int:
        """After step `done`: ONE collective agrees on a stop signal (any rank's) and on whether
        every async shard is written; then publish/save. Returns the agreed stop request."""
        stop, unfinished = self.boundary.agree(flag.value, self.writer.unfinished())
        if not unfinished:
            self.writer.all_written()
        self.maybe_save(done, end, force=stop != NONE)
        if stop != NONE:
            self.writer.finish()  # the checkpoint is complete before anyone exits or requeues
        return stop

    def fit(self, stop_after: Optional[int] = None, flag: Optional[PreemptFlag] = None) -> dict[str, Any]:
        """Train to train.max_steps, resuming from a checkpoint when there is one.

        `stop_after` ends the run early after that many steps, as a preempted job
        would, saving a checkpoint there (when train.save_every > 0); the LR
        schedule still follows max_steps, so a resumed run continues exactly.
        A SIGUSR1/SIGTERM (`flag`, installed here unless the caller installed one
        earlier) stops every rank after the same step with a checkpoint; the
        summary then carries `stopped_by` and `requeue` and no summary.json is written.
        """
        with contextlib.ExitStack() as scope:
            if flag is None:
                flag = scope.enter_context(PreemptFlag())
            return self._fit(stop_after, flag)

    def _fit(self, stop_after: Optional[int], flag: PreemptFlag) -> dict[str, Any]:
        cfg = self.cfg.train
        start = time.perf_counter()
        first = self.resume()
        end = cfg.max_steps if stop_after is None else min(stop_after, cfg.max_steps)
        # A resumed run evaluated at `first` already (its lines are in metrics.jsonl).
        last_eval = self.evaluate(0) if first == 0 else {"step": first}
        bar = tqdm(total=cfg.max_steps, initial=first, disable=not (self.is_writer and cfg.progress),
                   desc="train", dynamic_ncols=True, mininterval=1.0)
        bar.set_postfix(self._postfix(None, last_eval))
        last: Optional[dict[str, float]] = None
        tokens, train_time, stop = 0, 0.0, NONE
        for step in range(first, end):
            t0 = time.perf_counter()
            last = self.train_step(step)
            dt = time.perf_counter() - t0
            tokens, train_time = tokens + last["tokens"], train_time + dt
            self.metrics.write(step=step + 1, loss=last["loss"], lr=last["lr"], grad_norm=last["grad_norm"],
                               tokens_per_s=last["tokens"] / dt, comm_bytes=self.reducer.take_sent_bytes(),
                               **{k: last[k] for k in ("loss_scale", "skipped_steps") if k in last},
                               **self._mfu(last["tokens"] / dt), **{k: last[k] for k in PHASE_KEYS if k in last})
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
                last_eval = self.evaluate(step + 1)
            # After eval, so the saved RNG state is the next step's.
            stop = self.step_boundary(step + 1, end, flag)
            bar.update(1)
            bar.set_postfix(self._postfix(last, last_eval))
            if stop != NONE and step + 1 == cfg.max_steps:
                stop = NONE  # the signal came after the last step: finished (summary), nothing to requeue
            if stop != NONE:
                break
        bar.close()
        self.writer.finish()  # a run that ends publishes its pending async save
        summary = self._summary(last, last_eval, tokens, train_time, time.perf_counter() - start)
        if stop != NONE:  # not finished: no summary.json or export; run_rank requeues on REQUEUE
            summary.update(stopped_by=flag.signal_name or "another rank's signal", requeue=stop == REQUEUE)
        elif self.cfg.train.export_hf:
            self.export()
        if self.is_writer and stop == NONE:
            write_summary(self.run_dir, summary)
        self.metrics.close()
        return summary

    def export(self) -> None:
        from megaft.data.tokenizer import tokenizer_file
        from megaft.models.hf import export_hf

        tok_json = None
        if self.cfg.data.tokenizer or self.cfg.model.init_from:
            tok_json = tokenizer_file(self.cfg.data.tokenizer or self.cfg.model.init_from)
        elif self.is_writer:
            tok_json = os.path.join(self.run_dir, "tokenizer.json")
            self.tok.save(tok_json)
        grid = self.grid  # under pp, each stage's tp_rank 0 (first dp replica) writes its own tensors
        export_hf(self.model, self.cfg.model, os.path.join(self.run_dir, "hf"), tokenizer_json=tok_json,
                  tp_group=grid.tp_group, pp_group=grid.pp_group, is_writer=grid.tp_rank == 0 and grid.dp_rank == 0)

    @staticmethod
    def _postfix(train: Optional[dict[str, float]], ev: dict[str, Any]) -> dict[str, str]:
        out = {}
        if train is not None:
            out["loss"] = f"{train['loss']:.4f}"
        if "eval_loss" in ev:
            out["eval"] = f"{ev['eval_loss']:.4f}"
        if "eval_accuracy" in ev:
            out["acc"] = f"{ev['eval_accuracy']:.1%}"
        return out

    def model_params(self) -> int:
        """Parameters of the whole (unsharded, unpadded) model."""
        if self.pipeline is None:
            return sum(math.prod(full_shape(p, self.grid.tp_size)) for p in self.flat.params)
        local = sum(math.prod(full_shape(p, self.grid.tp_size)) for p in self.model.norm_params())
        total = torch.tensor(float(local), dtype=torch.float64, device=self.grid.device)
        return int(all_reduce(total, self.grid.pp_group).item())

    def _mfu(self, tokens_per_s: Optional[float]) -> dict[str, float]:
        """{"mfu": ...} when the peak is known (megaft.training.flops), else {}."""
        if self.peak_tflops is None or not tokens_per_s:
            return {}
        return {"mfu": mfu(tokens_per_s, self.flops_per_token, self.grid.world_size, self.peak_tflops)}

    def _summary(self, last, last_eval, tokens, train_time, wall) -> dict[str, Any]:
        grid = self.grid
        summary: dict[str, Any] = {
            "steps": self.cfg.train.max_steps, "final_loss": last["loss"] if last else None,
            "tokens": tokens, "tokens_per_s": tokens / train_time if train_time else None,
            "wall_s": wall, "world_size": grid.world_size, "tp": grid.tp_size, "dp": grid.dp_size,
            "pp": grid.pp_size, "sequence_parallel": self.cfg.parallel.sequence_parallel,
            "precision": self.cfg.precision, "device": str(grid.device), "model": self.cfg.model.name,
            "params": self.model_params(),
            # ZeRO: this rank's bytes held for params, grads and optimizer state (megaft.optim.zero).
            "zero": self.cfg.parallel.zero, "memory_bytes": self.optimizer.memory_bytes(),
            # op -> {backend, source: measured | cache | fixed | config | cpu[, ms]} (megaft.kernels.autotune)
            "kernels": self.kernel_choices,
        }
        summary.update({k: v for k, v in last_eval.items() if k != "step"})
        if grid.device.type == "cuda":
            summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(grid.device)
            summary["device_name"] = torch.cuda.get_device_name(grid.device)
        else:  # CPU: this rank's peak resident set (Linux reports ru_maxrss in KiB)
            import resource

            summary["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # megaft-report's MFU: model FLOPs per token need the shape and the sequence length.
        summary.update(n_layers=self.cfg.model.n_layers, dim=self.cfg.model.dim, seq_len=self.cfg.data.seq_len,
                       flops_per_token=self.flops_per_token, peak_tflops=self.peak_tflops,
                       **self._mfu(summary["tokens_per_s"]))
        return summary
