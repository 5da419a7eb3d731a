"""The training loop of one rank: the algorithm, over the parts a run is composed of.

Each step takes this rank's micro-batches of the global batch (the data part), runs their
forward and backward through the step part (plain or pipeline), lets the optimizer part
take its step (dp reduction, clipping, AdamW), sums the loss over the replicas, and hands
the numbers to the records part (metrics, the stop agreement, checkpoints). The parts
(megaft.training.parts; their surface: megaft.training.protocols) own their internals.

The global batch of each step is a pure function of (data seed, step), identical
on every rank; a rank takes its dp slice and splits it into micro-batches. Each
micro-batch's summed token loss is divided by the target count of the WHOLE
global batch, so the accumulated, dp-summed gradient is exactly the gradient of
the token-weighted mean loss for any (tp, dp, micro-batch) split.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import torch
from tqdm import tqdm

from megaft.config import Config
from megaft.config.keep import exports_hf
from megaft.models.attention.gqa import attention_record
from megaft.models.moe.metrics import moe_record
from megaft.optim.schedule import lr_at
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import flops_per_token, mfu
from megaft.perf.hardware import device_peak_tflops
from megaft.training.evaluate import eval_accuracy
from megaft.training.model import model_params
from megaft.training.parts import TrainSpec
from megaft.training.samples import Sampler, opening
from megaft.training.stop import NONE, REQUEUE, PreemptFlag
from megaft.training.summary import RunSummary


def dropout_seed(seed: int, grid: ParallelGrid) -> int:
    """The seed of this rank's dropout stream: shared by the tp ranks (they draw whole masks and
    keep their slices, megaft.layers.dropout), its own per dp×cp replica and pipeline stage, so
    no two ranks draw the same masks for other tokens or layers (7919 is prime: no collisions
    below 1000 stages)."""
    return seed + 1000 * grid.replica_rank + 7919 * grid.pp_rank


class Trainer:
    """One rank's run, composed of the parts a `TrainSpec` builds into `self.parts`
    (megaft.training.parts): data, kernels, model, optim, step, records and export. It
    sequences their typed surface (megaft.training.protocols); it never reaches into them."""

    def __init__(self, cfg: Config, grid: ParallelGrid, run_dir: str, *, spec: TrainSpec = TrainSpec()):
        if cfg.train.max_steps is None:  # a run sized by train.epochs: megaft-train resolves it before any rank
            raise ValueError("train.max_steps is unset: resolve train.epochs first (megaft.training.epochs."
                             "resolve_epochs), or set train.max_steps")
        self.cfg, self.grid, self.run_dir = cfg, grid, run_dir
        self.is_writer = grid.rank == 0
        torch.manual_seed(dropout_seed(cfg.train.seed, grid))
        self.parts = spec.build(cfg, grid, run_dir)
        # MFU (megaft.perf): None on CPU unless train.peak_tflops is set.
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len, cfg.lora)
        self.peak_tflops = device_peak_tflops(grid.device, cfg.precision, cfg.train.peak_tflops)
        self.current_step: Optional[int] = None  # the step being trained (hang reports)
        self.sampler = self._sampler() if cfg.train.sample_every > 0 else None  # samples.jsonl

    def _sampler(self) -> Sampler:
        from megaft.data.templates import load_chat_template, tokenizer_dir_of

        cfg, data = self.cfg, self.parts.data
        template = load_chat_template(cfg.data.chat_template, tokenizer_dir_of(cfg.data.tokenizer, cfg.model.init_from))
        # every eos of the checkpoint's config.json ends a sample (Llama 3.1 lists the end of a turn too)
        listed = cfg.model.extra.get("eos_token_id")
        eos = {data.eos_id, *(listed if isinstance(listed, list) else [listed])} - {None}
        return Sampler(cfg.sample, tokenizer=data.tokenizer, template=template, eos_id=sorted(eos),
                       run_dir=self.run_dir, is_writer=self.is_writer, text=self.parts.records.metrics.text)

    @property
    def current_action(self):
        """The pipeline action in hand (hang reports), or None."""
        return self.parts.step.current_action

    def train_step(self, step: int) -> dict[str, float]:
        """Optimizer step `step` (0-based): batches, forward/backward, the optimizer's step, the
        loss over the replicas; returns the numbers of its metrics line."""
        data, fwd_bwd, optim, phases = self.parts.data, self.parts.step, self.parts.optim, self.parts.phases
        batch = data.batch(step)
        divisor = optim.loss_divisor(batch.n_targets)
        phases.start_step()
        loss_sum = fwd_bwd.forward_backward(batch, divisor)
        stats = optim.step(lr_at(step, self.cfg.optim, self.cfg.train.max_steps))
        loss_sum = fwd_bwd.total_loss(loss_sum)
        out = {"loss": (loss_sum / batch.n_targets).item(), "lr": stats.lr, "grad_norm": stats.grad_norm.item(),
               "tokens": batch.tokens, "vision_flops": getattr(batch, "vision_flops", 0.0)}
        out.update(fwd_bwd.step_metrics())
        fwd_bwd.finish_step()
        out.update(stats.scaler_record())
        out.update(phases.result())
        return out

    def evaluate(self, step: int) -> dict[str, Any]:
        data, fwd_bwd = self.parts.data, self.parts.step
        record: dict[str, Any] = {"step": step}
        with self.parts.optim.whole_params():  # ZeRO-3: whole layers while evaluating
            loss = fwd_bwd.eval_loss(data.eval_batches)
            if loss is not None:
                record["eval_loss"] = loss
            # an objective's own held-out metrics (a reward model's pairwise eval_accuracy, its rewards)
            record.update(getattr(fwd_bwd, "last_eval", None) or {})
            if data.task is not None:  # under pp, greedy generation runs through the stages
                record["eval_accuracy"] = eval_accuracy(fwd_bwd.generator, data.task, data.tokenizer, data.eos_id,
                                                        self.grid, fwd_bwd.autocast)
        self.parts.records.log(**record)
        return record

    def sample(self, step: int) -> Optional[str]:
        """Generate from sample.prompts at `step` (collective; rank 0 writes samples.jsonl); the
        first sample's opening words, for the progress bar."""
        fwd_bwd = self.parts.step
        with self.parts.optim.whole_params():  # ZeRO-3: whole layers while generating
            lines = self.sampler.run(fwd_bwd.generator, step, device=self.grid.device, autocast=fwd_bwd.autocast)
        return opening(lines[0]["text"]) if lines else None

    def resume(self) -> int:
        """Load the newest complete checkpoint when train.resume is on; the step to continue from.
        Another model, or another LoRA base, than the checkpoint's is an error."""
        if not self.cfg.train.resume:
            return 0
        records = self.parts.records
        step = self.parts.optim.restore(records.checkpoint_dir, records.meta)
        if step is None:
            return 0
        records.resumed_at(step)
        return step

    def maybe_save(self, done: int, end: int, *, force: bool = False) -> None:
        """Checkpoint after `done` steps every train.save_every steps, when the run stops at `end`,
        and always when `force` (a preemption signal: losing the work would be worse)."""
        records = self.parts.records
        if records.should_save(done, end, force=force):
            records.save(done, self.parts.optim.capture(done))

    def step_boundary(self, done: int, end: int, flag: PreemptFlag) -> int:
        """After step `done`: ONE collective agrees on a stop signal (any rank's) and on whether
        every async shard is written; then publish/save. Returns the agreed stop request."""
        stop = self.parts.records.agree(flag.value)
        self.maybe_save(done, end, force=stop != NONE)
        if stop != NONE:
            self.parts.records.finish_saves()  # the checkpoint is complete before anyone exits or requeues
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
        cfg, records = self.cfg.train, self.parts.records
        records.start(self.cfg)  # config.yaml: what this attempt runs
        self.parts.export.save_own_tokenizer()  # the demo's character vocabulary, for megaft-chat
        start = time.perf_counter()
        first = self.resume()
        finished = RunSummary.read(self.parts.run_dir) if first and first >= cfg.max_steps else None
        if finished is not None:  # run again after it finished (its final checkpoint): it stays as it was
            records.close()
            return finished.to_json()
        end = cfg.max_steps if stop_after is None else min(stop_after, cfg.max_steps)
        # A resumed run evaluated at `first` already (its lines are in metrics.jsonl).
        last_eval = self.evaluate(0) if first == 0 else {"step": first}
        last_sample = None
        if self.sampler is not None and first == 0:
            last_sample = self.sample(0)
        elif self.sampler is not None:  # a resumed run drops the samples written after its checkpoint
            self.sampler.resumed_at(first)
        bar = tqdm(total=cfg.max_steps, initial=first, disable=not (self.is_writer and cfg.progress),
                   desc="train", dynamic_ncols=True, mininterval=1.0)
        bar.set_postfix(self._postfix(None, last_eval, last_sample))
        last: Optional[dict[str, float]] = None
        tokens, train_time, stop, vision_flops = 0, 0.0, NONE, 0.0
        for step in range(first, end):
            self.current_step = step + 1  # the step being trained, as metrics.jsonl numbers it (hang reports)
            t0 = time.perf_counter()
            last = self.train_step(step)
            dt = time.perf_counter() - t0
            tokens, train_time = tokens + last["tokens"], train_time + dt
            # raises after train.max_bad_steps non-finite steps in a row
            vision_flops += last["vision_flops"]
            records.log_train(step + 1, last, dt, comm_bytes=self.parts.optim.take_sent_bytes(),
                              mfu=self._mfu(last["tokens"] / dt, self._per_token(last["tokens"], last["vision_flops"])))
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
                last_eval = self.evaluate(step + 1)
            if self.sampler is not None and ((step + 1) % cfg.sample_every == 0 or step + 1 == cfg.max_steps):
                last_sample = self.sample(step + 1)
            # After eval, so the saved RNG state is the next step's.
            stop = self.step_boundary(step + 1, end, flag)
            bar.update(1)
            bar.set_postfix(self._postfix(last, last_eval, last_sample))
            if stop != NONE and step + 1 == cfg.max_steps:
                stop = NONE  # the signal came after the last step: finished (summary), nothing to requeue
            if stop != NONE:
                break
        bar.close()
        records.finish_saves()  # a run that ends publishes its pending async save
        summary = self._summary(last, last_eval, tokens, train_time, time.perf_counter() - start, vision_flops)
        result = summary.to_json()
        if stop != NONE:  # not finished: no summary.json or export; run_rank requeues on REQUEUE
            result.update(stopped_by=flag.signal_name or "another rank's signal", requeue=stop == REQUEUE)
        else:
            if exports_hf(self.parts.cfg):
                self.parts.export.write()
            records.write_summary(summary)
        records.close()
        return result

    @staticmethod
    def _postfix(train: Optional[dict[str, float]], ev: dict[str, Any], sample: Optional[str] = None
                 ) -> dict[str, str]:
        out = {}
        if train is not None:
            out["loss"] = f"{train['loss']:.4f}"
        if "eval_loss" in ev:
            out["eval"] = f"{ev['eval_loss']:.4f}"
        if "eval_accuracy" in ev:
            out["acc"] = f"{ev['eval_accuracy']:.1%}"
        if sample is not None:
            out["sample"] = sample
        return out

    def _per_token(self, tokens: int, vision_flops: float) -> float:
        """Model FLOPs per token of `tokens` whose images cost `vision_flops` in the tower: the text's
        flops_per_token plus the tower's share (a VLM, megaft.perf.vision)."""
        return self.flops_per_token + (vision_flops / tokens if tokens else 0.0)

    def _mfu(self, tokens_per_s: Optional[float], per_token: Optional[float] = None) -> dict[str, float]:
        """{"mfu": ...} when the peak is known (megaft.perf), else {}; `per_token`: the FLOPs per
        token (default flops_per_token; a VLM's step adds its tower's, `_per_token`)."""
        if self.peak_tflops is None or not tokens_per_s:
            return {}
        return {"mfu": mfu(tokens_per_s, per_token or self.flops_per_token, self.grid.world_size, self.peak_tflops)}

    def _summary(self, last, last_eval, tokens, train_time, wall, vision_flops: float = 0.0) -> RunSummary:
        cfg, grid, parts = self.cfg, self.grid, self.parts
        tokens_per_s = tokens / train_time if train_time else None
        summary = RunSummary(
            steps=cfg.train.max_steps, final_loss=last["loss"] if last else None,
            eval_loss=last_eval.get("eval_loss"), eval_accuracy=last_eval.get("eval_accuracy"),
            tokens=tokens, tokens_per_s=tokens_per_s, wall_s=wall,
            world_size=grid.world_size, tp=grid.tp_size, dp=grid.dp_size, pp=grid.pp_size, cp=grid.cp_size,
            sequence_parallel=cfg.parallel.sequence_parallel, precision=str(cfg.precision), device=str(grid.device),
            # collectives under pp (a sum over the stages): the same order on every rank
            model=cfg.model.name, params=model_params(parts.model, grid),
            trainable_params=model_params(parts.model, grid, trainable=True),
            # ZeRO: this rank's bytes held for params, grads and optimizer state (megaft.optim.zero).
            zero=cfg.parallel.zero, memory_bytes=parts.optim.memory_bytes(), kernels=parts.kernels.record,
            attention=attention_record(cfg.model, packing=parts.data.packing, cp=grid.cp_size,
                                       seq_len=cfg.data.seq_len, device=grid.device,
                                       shared_prefix=cfg.pref.share_prompt),
            packing=parts.data.packing, hf_ignore_keys=list(cfg.model.hf_ignore_keys) or None,
            conversations_without_assistant=parts.data.untrained,
            dropped_long=getattr(parts.data, "dropped_long", None),  # an image chat's (never cut)
            moe=moe_record(cfg.model, parts.kernels.record, ep=cfg.parallel.ep, routing=cfg.moe),
            reference_s=parts.step.reference_s, optimizer=getattr(parts.optim.optimizer, "record", None),
            # megaft-report's MFU: model FLOPs per token need the shape and the sequence length (a VLM's:
            # the run's mean, its images' tower FLOPs spread over its tokens)
            n_layers=cfg.model.n_layers, dim=cfg.model.dim, seq_len=cfg.data.seq_len,
            flops_per_token=self._per_token(tokens, vision_flops), peak_tflops=self.peak_tflops,
            **self._mfu(tokens_per_s, self._per_token(tokens, vision_flops)))
        if grid.device.type == "cuda":
            summary.peak_memory_bytes = torch.cuda.max_memory_allocated(grid.device)
            summary.device_name = torch.cuda.get_device_name(grid.device)
        else:  # CPU: this rank's peak resident set (Linux reports ru_maxrss in KiB)
            import resource

            summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return summary
