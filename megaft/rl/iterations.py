"""rl.num_iterations = mu: one generated (or read) global batch trained on for mu optimizer steps,
as TRL's GRPOTrainer reuses its buffered generation batch (generate_every = steps_per_generation
x num_iterations).

The clipped ratio's old log-probs are the generating weights'. megaft takes them from the first
of the mu steps' own forward, detached (the same weights and rows TRL scores right after
generating: one forward fewer), per micro-batch at the rank's layout. They and the generation's
groups and rewards go to RUN_DIR/rl_state/generation<g>.rank<r>.pt after that first step, so a run
resumed inside a generation reads them back: the weights that made them are in no checkpoint,
and under rl.prompts neither are the groups they sampled. The file holds this rank's shards of
the old log-probs (its dp share, its cp chunks, the last pp stage's), so a resume inside a
generation runs at the layout that wrote it (checked); at a generation's first step nothing is read.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from megaft.parallel.grid import ParallelGrid
from megaft.rl.rollouts import Group


@dataclass
class Generation:
    """One generated (or read) global batch, trained on for rl.num_iterations steps, and this rank's
    old log-probs of it: micro-batch -> [rows, tokens] of the generating weights (the first step's
    forward; under pp the last stage's, under cp this rank's chunks)."""

    index: int
    groups: list[Group]
    rewards: torch.Tensor  # [completions, functions]
    old_logps: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def path(run_dir: str, index: int, rank: int) -> str:
        return os.path.join(run_dir, "rl_state", f"generation{index}.rank{rank}.pt")

    def save(self, run_dir: str, grid: ParallelGrid, layout: dict, keep_from: int) -> None:
        """Write this rank's state of the generation; drop its files of generations before `keep_from`
        (older than the newest periodic checkpoint's: no resume reads them)."""
        path = self.path(run_dir, self.index, grid.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        groups = [dict(prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, rewards=g.rewards, extras=g.extras)
                  for g in self.groups]
        torch.save({"index": self.index, "layout": layout, "groups": groups, "rewards": self.rewards,
                    "old_logps": {i: t.cpu() for i, t in self.old_logps.items()}}, path + ".tmp")
        os.replace(path + ".tmp", path)  # whole or absent
        folder, mine = os.path.dirname(path), f".rank{grid.rank}.pt"
        for name in os.listdir(folder):
            index = name[len("generation"):-len(mine)] if name.startswith("generation") and name.endswith(mine) else ""
            if index.isdigit() and int(index) < keep_from:
                os.remove(os.path.join(folder, name))

    @classmethod
    def load(cls, run_dir: str, index: int, step: int, grid: ParallelGrid, layout: dict) -> "Generation":
        """This rank's saved state of generation `index`, read by a run resumed at `step` inside it."""
        path = cls.path(run_dir, index, grid.rank)
        where = (f"the run resumes at step {step + 1}, inside generation {index}'s rl.num_iterations steps, "
                 "whose old log-probs came from weights no checkpoint holds")
        if not os.path.isfile(path):
            raise ValueError(f"{where}, and {path} is missing; fix: resume from a checkpoint at a multiple of "
                             "rl.num_iterations (train.save_every a multiple of it), or restore the file")
        state = torch.load(path, weights_only=True)
        if state["layout"] != layout:
            raise ValueError(f"{where}, saved at the layout {state['layout']}, and this run's is {layout}; fix: "
                             "resume at the saved layout until the generation's steps are done")
        groups = [Group(g["prompt_ids"], g["completion_ids"], g["rewards"], g["extras"]) for g in state["groups"]]
        return cls(index, groups, state["rewards"], state["old_logps"])
