"""train.objective=distill with distill.lmbda or distill.seq_kd: steps on generated completions
(TRL's GKDTrainer; the draws and the rows in megaft.distill.policy).

The data part is sft's with data.packing=none (one example a row). A step on the data's
completions is sft's batch as it is. A generated step takes the same rows' examples, cuts each to
its prompt, and has the student (or, with seq_kd, the teacher) sample a completion of each at the
training layout (megaft.inference.generate: tp ranks draw alike, through the pipeline's stages
under pp, ZeRO-3's layers gathered): each dp rank generates the step's prompts at positions
dp_rank, dp_rank + dp, ..., each alone with draws seeded by (train.seed, step, position) as GRPO's
online rollouts are (megaft.rl.online.draw_seed), so every layout samples the same tokens; the
completions are gathered over dp and the rows split as sft's are. The loss is the divergence on the
completion's tokens, divided by the generated batch's target count (TRL's Trainer counts
num_items_in_batch on the data's labels before GKD replaces them; megaft's divisor is the batch
trained on).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch.distributed as dist

from megaft.config.distill import DistillConfig
from megaft.data.batches import count_targets
from megaft.distill.policy import DATA, STUDENT, batch_source, generated_rows, prompt_of
from megaft.inference.generate import Sampling, generate, pipeline_generate
from megaft.models.decoder import Decoder
from megaft.rl.online import draw_seed
from megaft.training.objectives.sft import DataParts, micro_batches
from megaft.training.protocols import RunParts, StepBatch

__all__ = ["GeneratedBatch", "PolicyData", "completion_generator", "source_metrics", "with_generation"]

# (whose: STUDENT | TEACHER, {position: (prompt ids, max new tokens)}, step) -> {position: the completion's ids}
Generate = Callable[[str, dict[int, tuple[list[int], int]], int], dict[int, list[int]]]


@dataclasses.dataclass
class GeneratedBatch(StepBatch):
    """A step's micro-batches, with who wrote their completions (megaft.distill.policy's DATA, STUDENT, TEACHER)."""

    source: str = DATA


@dataclasses.dataclass
class PolicyData(DataParts):
    """sft's data part (packing=none), each step on the data's completions or on generated ones."""

    distill: Optional[DistillConfig] = None
    seed: int = 0  # train.seed: which steps generate, and the draws
    seq_len: int = 0
    pad_id: int = 0
    generate: Optional[Generate] = None  # attached by the step part (megaft.training.objectives.distill)

    def batch(self, step: int) -> StepBatch:
        d = self.distill
        source = batch_source(self.seed, step, d.lmbda, d.seq_kd)
        if source == DATA:
            return super().batch(step)
        prompts = self.prompts(step)
        completions = self.completions(source, step, prompts)
        inputs, labels = generated_rows(prompts, completions, self.seq_len, self.pad_id)
        micro_in, micro_lab, micro_docs = micro_batches(inputs, labels, None, self.grid, self.micro_batch_size)
        return GeneratedBatch(micro_in, micro_lab, micro_docs, max(count_targets(labels), 1), int(inputs.numel()),
                              source=source)

    def prompts(self, step: int) -> list[list[int]]:
        """The prompts of step `step`'s rows (each row's example: packing=none)."""
        corpus = self.stream.corpus
        return [prompt_of(*corpus.doc(row[0][0]), self.seq_len) for row in
                self.stream.pieces(step, self.global_batch_size)]

    def completions(self, source: str, step: int, prompts: list[list[int]]) -> list[list[int]]:
        """Every prompt's completion by `source` (collective: this dp rank's share generated, then gathered)."""
        if self.generate is None:
            raise RuntimeError("PolicyData.generate is not attached (megaft.training.objectives.distill.build_step)")
        grid = self.grid
        asked = {j: (prompts[j], min(self.distill.max_new_tokens, self.seq_len - len(prompts[j])))
                 for j in range(grid.dp_rank, len(prompts), grid.dp_size)}
        mine = self.generate(source, asked, step)
        made = [mine]
        if grid.dp_size > 1:
            made = [None] * grid.dp_size
            dist.all_gather_object(made, mine, group=grid.dp_group)
        done = {j: c for part in made for j, c in part.items()}
        return [done[j] for j in range(len(prompts))]


def with_generation(data: DataParts, parts: RunParts) -> PolicyData:
    """`data` (sft's, packing=none: validated) as PolicyData."""
    cfg = parts.cfg
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(DataParts)}
    return PolicyData(**fields, distill=cfg.distill, seed=cfg.train.seed, seq_len=cfg.data.seq_len,
                      pad_id=data.stream.pad_id)


def completion_generator(parts: RunParts, student, teacher, autocast) -> Generate:
    """Sampling at distill.sampling_temperature (0: greedy; no nucleus, no top-k: GKD's generation config)
    from the student (`student`: a Decoder or the pipeline runtime) or the teacher, each completion ended
    by (and keeping) the first eos of the checkpoint's list."""
    cfg, grid = parts.cfg, parts.grid
    sampling = Sampling(temperature=cfg.distill.sampling, top_p=1.0, seed=cfg.train.seed)
    listed = cfg.model.extra.get("eos_token_id")  # a checkpoint may list several (an end of turn)
    eos = sorted({parts.data.eos_id, *(listed if isinstance(listed, list) else [listed])} - {None})

    def one(model, prompt: list[int], max_new_tokens: int, seed_step: int) -> list[int]:
        kw = dict(max_new_tokens=max_new_tokens, eos_id=eos, sampling=sampling, step=seed_step, keep_eos=True)
        if isinstance(model, Decoder):
            with autocast():
                return generate(model, [prompt], device=grid.device, **kw)[0]
        return pipeline_generate(model, [prompt], autocast=autocast, **kw)[0]

    def run(source: str, asked: dict[int, tuple[list[int], int]], step: int) -> dict[int, list[int]]:
        model = student if source == STUDENT else teacher
        # the student's ZeRO-3 shards gathered once for the step's prompts; the teacher is whole. Each prompt
        # alone, its draws seeded by its position (megaft.rl.online.draw_seed): the same at every layout
        with parts.optim.whole_params() if source == STUDENT else contextlib.nullcontext():
            return {j: one(model, prompt, room, draw_seed(step, j)) for j, (prompt, room) in asked.items()}
    return run


def source_metrics(cfg: DistillConfig, source: Optional[str]) -> dict[str, float]:
    """The step's metrics of who wrote its completions (with lmbda or seq_kd only): on_policy (the student)
    and teacher_completions (seq_kd)."""
    if not cfg.generates or source is None:
        return {}
    out = {"on_policy": float(source == STUDENT)}
    if cfg.seq_kd:
        out["teacher_completions"] = float(source not in (STUDENT, DATA))
    return out
