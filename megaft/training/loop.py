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
from megaft.data import count_targets
from megaft.models.attention import attention_record
from megaft.models.docs import Docs, context_shard
from megaft.optim import clip_grad_norm_, lr_at
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.shard import full_shape
from megaft.perf.counts import flops_per_token, mfu
from megaft.perf.hardware import device_peak_tflops
from megaft.training.evaluate import eval_accuracy
from megaft.training.metrics import write_summary
from megaft.training.parts import TrainSpec
from megaft.training.phases import PHASE_KEYS, PhaseTimer
from megaft.training.stop import NONE, REQUEUE, PreemptFlag


def micro_batches(inputs: torch.Tensor, labels: torch.Tensor, docs: Optional[Docs], grid: ParallelGrid,
                  size: int) -> tuple[list, list, Optional[list]]:
    """This rank's micro-batches of a global batch: its dp share of the rows and, under
    context parallelism, its cp chunks of their tokens (megaft.models.docs.context_shard)."""
    share = inputs.shape[0] // grid.dp_size
    rows = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)
    micro_in, micro_lab = list(inputs[rows].split(size)), list(labels[rows].split(size))
    micro_docs = None if docs is None else [
        Docs(p, d) for p, d in zip(docs.position_ids[rows].split(size), docs.doc_ids[rows].split(size))]
    if grid.cp_size > 1:
        parts = [context_shard(i, lab, d, grid.cp_group)
                 for i, lab, d in zip(micro_in, micro_lab, micro_docs or [None] * len(micro_in))]
        micro_in, micro_lab, micro_docs = (list(x) for x in zip(*parts))
    return micro_in, micro_lab, micro_docs


def dropout_seed(seed: int, grid: ParallelGrid) -> int:
    """The seed of this rank's dropout stream: shared by the tp ranks (they draw whole masks and
    keep their slices, megaft.layers.dropout), its own per dp×cp replica and pipeline stage, so
    no two ranks draw the same masks for other tokens or layers (7919 is prime: no collisions
    below 1000 stages)."""
    return seed + 1000 * grid.replica_rank + 7919 * grid.pp_rank


class Trainer:
    """One rank's run, composed of the parts a `TrainSpec` builds (megaft.training.parts):
    data, kernels, model, optimizer, and the step (plain or pipeline), plus metrics,
    phase timing and checkpointing. It calls them; it never reaches into them."""

    def __init__(self, cfg: Config, grid: ParallelGrid, run_dir: str, *, spec: TrainSpec = TrainSpec()):
        self.cfg, self.grid, self.run_dir = cfg, grid, run_dir
        self.is_writer = grid.rank == 0
        torch.manual_seed(dropout_seed(cfg.train.seed, grid))
        self.data = spec.data(cfg, grid)
        kernels, self.kernel_choices = spec.kernels(cfg, grid)
        self.model = spec.model(cfg, grid, kernels)
        self.optim = spec.optim(cfg, grid, self.model)
        self.flat, self.optimizer, self.reducer = self.optim.flat, self.optim.optimizer, self.optim.reducer
        self.scaler = self.optim.scaler
        self.phases = PhaseTimer(grid.device, enabled=cfg.train.log_phases)
        self.step = spec.step(cfg, grid, self.model, self.optim, self.phases)
        records = spec.records(cfg, grid, run_dir)
        self.metrics, self.writer, self.boundary = records.metrics, records.writer, records.boundary
        self.guard, self.stragglers, self.checkpoint_dir = records.guard, records.stragglers, records.checkpoint_dir
        # MFU (megaft.perf): None on CPU unless train.peak_tflops is set.
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len, cfg.lora)
        self.peak_tflops = device_peak_tflops(grid.device, cfg.precision, cfg.train.peak_tflops)
        self.current_step: Optional[int] = None  # the step being trained (hang reports)

    @property
    def current_action(self):
        """The pipeline action in hand (hang reports), or None."""
        return self.step.current_action

    def autocast(self):
        if self.cfg.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
            return torch.autocast(self.grid.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> dict[str, float]:
        cfg, grid = self.cfg.train, self.grid
        inputs, labels, docs = self.data.global_batch(step, cfg.global_batch_size)
        n_targets = max(count_targets(labels), 1)
        micro_in, micro_lab, micro_docs = micro_batches(inputs, labels, docs, grid, cfg.micro_batch_size)
        # fp16 backpropagates loss * scale: dividing by n_targets / scale keeps one code path.
        divisor = n_targets / self.scaler.scale if self.scaler else n_targets
        phase = self.phases.phase
        self.phases.start_step()
        loss_sum = self.step.forward_backward(micro_in, micro_lab, divisor, self.autocast, micro_docs)
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
            all_reduce(loss_sum, grid.replica_group)  # dp×cp: cp ranks hold parts of each row
        out = {"loss": (loss_sum / n_targets).item(), "lr": lr, "grad_norm": norm.item(),
               "tokens": int(inputs.numel())}
        if self.scaler:
            out.update(loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped)
        out.update(self.phases.result())
        return out

    def evaluate(self, step: int) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step}
        with self.optimizer.whole_params():  # ZeRO-3: whole layers while evaluating
            loss = self.step.eval_loss(self.data.eval_batches, self.autocast)
            if loss is not None:
                record["eval_loss"] = loss
            if self.data.task is not None:  # under pp, greedy generation runs through the stages
                record["eval_accuracy"] = eval_accuracy(self.step.generator, self.data.task, self.data.tokenizer,
                                                        self.data.eos_id, self.grid, self.autocast)
        self.metrics.write(**record)
        return record

    def resume(self) -> int:
        """Load the newest complete checkpoint when train.resume is on; the step to continue from."""
        if not self.cfg.train.resume:
            return 0
        step = checkpoint.load_latest(self.checkpoint_dir, self.flat, self.optimizer, self.grid, model=self.model,
                                      reducer=self.reducer,  # + PowerSGD state (megaft.checkpoint.state)
                                      model_config=self.writer.meta["model"],  # another model: an error
                                      lora=self.writer.meta.get("lora", {}))  # another LoRA base: an error
        if step is None:
            return 0
        if self.is_writer:
            checkpoint.trim_metrics(self.metrics.path, step)
        return step

    def maybe_save(self, done: int, end: int, *, force: bool = False) -> None:
        """Checkpoint after `done` steps every train.save_every steps, when the run stops at `end`,
        and always when `force` (a preemption signal: losing the work would be worse)."""
        every = self.cfg.train.save_every
        if (force or (every and (done % every == 0 or done == end))) and self.guard.may_save():
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
            self.current_step = step + 1  # the step being trained, as metrics.jsonl numbers it (hang reports)
            t0 = time.perf_counter()
            last = self.train_step(step)
            dt = time.perf_counter() - t0
            tokens, train_time = tokens + last["tokens"], train_time + dt
            # The rank's own work: the step minus the time it waited for the others (comm_s).
            spread = self.stragglers.observe(step + 1, dt - last.get("comm_s", 0.0))
            self.metrics.write(step=step + 1, loss=last["loss"], lr=last["lr"], grad_norm=last["grad_norm"],
                               tokens_per_s=last["tokens"] / dt, comm_bytes=self.reducer.take_sent_bytes(),
                               **{k: last[k] for k in ("loss_scale", "skipped_steps") if k in last},
                               **self._mfu(last["tokens"] / dt), **{k: last[k] for k in PHASE_KEYS if k in last},
                               **spread)
            self.guard.observe(step + 1, last)  # raises after train.max_bad_steps non-finite steps in a row
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
            self.data.tokenizer.save(tok_json)
        grid = self.grid  # under pp, each stage's tp_rank 0 (first dp×cp replica) writes its own tensors
        writer = grid.tp_rank == 0 and grid.replica_rank == 0
        if self.cfg.lora.rank > 0:  # a peft adapter folder in hf/ (+ the merged model in hf_merged/)
            from megaft.peft.export import export_lora

            return export_lora(self.model, self.cfg.model, self.cfg.lora, self.run_dir, tokenizer_json=tok_json,
                               tp_group=grid.tp_group, pp_group=grid.pp_group,
                               is_writer=writer)
        export_hf(self.model, self.cfg.model, os.path.join(self.run_dir, "hf"), tokenizer_json=tok_json,
                  tp_group=grid.tp_group, pp_group=grid.pp_group, is_writer=writer)

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

    def model_params(self, *, trainable: bool = False) -> int:
        """Parameters of the whole (unsharded, unpadded) model; `trainable`: only those the
        optimizer updates (LoRA: the adapters)."""
        copy = self.model.embed_tokens.weight if getattr(self.model, "tied_copy", False) else None
        local = sum(math.prod(full_shape(p, self.grid.tp_size)) for p in self.model.parameters()
                    if p is not copy and (p.requires_grad or not trainable))
        if self.grid.pp_size == 1:
            return local
        total = torch.tensor(float(local), dtype=torch.float64, device=self.grid.device)
        return int(all_reduce(total, self.grid.pp_group).item())

    def _mfu(self, tokens_per_s: Optional[float]) -> dict[str, float]:
        """{"mfu": ...} when the peak is known (megaft.perf), else {}."""
        if self.peak_tflops is None or not tokens_per_s:
            return {}
        return {"mfu": mfu(tokens_per_s, self.flops_per_token, self.grid.world_size, self.peak_tflops)}

    def _summary(self, last, last_eval, tokens, train_time, wall) -> dict[str, Any]:
        grid = self.grid
        summary: dict[str, Any] = {
            "steps": self.cfg.train.max_steps, "final_loss": last["loss"] if last else None,
            "tokens": tokens, "tokens_per_s": tokens / train_time if train_time else None,
            "wall_s": wall, "world_size": grid.world_size, "tp": grid.tp_size, "dp": grid.dp_size,
            "pp": grid.pp_size, "cp": grid.cp_size, "sequence_parallel": self.cfg.parallel.sequence_parallel,
            "precision": self.cfg.precision, "device": str(grid.device), "model": self.cfg.model.name,
            "params": self.model_params(), "trainable_params": self.model_params(trainable=True),
            # ZeRO: this rank's bytes held for params, grads and optimizer state (megaft.optim.zero).
            "zero": self.cfg.parallel.zero, "memory_bytes": self.optimizer.memory_bytes(),
            # op -> {backend, source: measured | cache | fixed | config | cpu[, ms]} (megaft.kernels.autotune)
            "kernels": self.kernel_choices,
            # ring (cp > 1) | flash_attn_varlen | flex_attention | sdpa_mask (packing=docs) | sdpa_window_mask | ..
            "attention": attention_record(self.cfg.model, packing=self.data.packing, cp=grid.cp_size,
                                          seq_len=self.cfg.data.seq_len, device=grid.device),
            "packing": self.data.packing,
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
