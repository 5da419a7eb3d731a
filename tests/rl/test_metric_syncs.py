"""GRPO's step metrics reach the host in one copy each (megaft.rl.advantages, megaft.rl.losses.GrpoStats):
on a GPU every `.item()` is a stream sync, and the completion metrics alone took seven a step. Each
function below makes exactly one host copy and no `.item()`, and its values are the definitions'
(each metric read on its own)."""
from __future__ import annotations

import math

import torch

from megaft.rl.advantages import completion_metrics, function_metrics, group_advantages, nanstd
from megaft.rl.losses import COLUMNS, GrpoStats


class HostCopies:
    """Counts Tensor.item and Tensor.tolist calls while the block runs."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("item", "tolist"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, original))

    def _counted(self, name, original):
        def call(tensor, *args):
            self.calls.append(name)
            return original(tensor, *args)
        return call


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:  # the same float32 values, one copy or several
        assert got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])), k


def test_each_metric_function_copies_to_the_host_once(monkeypatch):
    torch.manual_seed(0)
    rewards = torch.randint(0, 4, (8, 2)).float()
    rewards[3, 1] = float("nan")  # a declined completion
    lengths, truncated = torch.tensor([3, 5, 2, 8, 4, 4, 7, 1]), torch.tensor([0, 1, 0, 0, 1, 0, 0, 0]).bool()
    table = torch.rand(5, len(COLUMNS)) + 1
    stats = GrpoStats.of(table)
    want_lengths = {"mean_length": lengths.float().mean(), "min_length": lengths.float().min(),
                    "max_length": lengths.float().max(), "clipped_ratio": truncated.float().mean(),
                    "mean_terminated_length": lengths[~truncated].float().mean(),
                    "min_terminated_length": lengths[~truncated].float().min(),
                    "max_terminated_length": lengths[~truncated].float().max()}
    want_lengths = {f"completions/{k}": v.item() for k, v in want_lengths.items()}
    want_functions = {f"rewards/{n}/{m}": (torch.nanmean if m == "mean" else nanstd)(rewards[:, i]).item()
                      for i, n in enumerate(["a", "b"]) for m in ("mean", "std")}
    summed = rewards.nansum(dim=1)
    want_rewards = {"reward": summed.mean().item(), "reward_std": nanstd(summed).item()}
    sums = dict(zip(COLUMNS, table.sum(0).tolist()))
    n = sums["tokens"]
    some = table[:, 0] > 0
    want_stats = {"entropy": sums["entropy"] / n, "clip_ratio/low_min": (table[some, 3] / table[some, 0]).min().item(),
                  "clip_ratio/high_max": (table[some, 4] / table[some, 0]).max().item()}

    copies = HostCopies(monkeypatch)
    got = completion_metrics(lengths, truncated)
    assert copies.calls == ["tolist"]
    _same(got, want_lengths)
    copies.calls.clear()
    _same(function_metrics(rewards, ["a", "b"]), want_functions)
    assert copies.calls == ["tolist"]
    copies.calls.clear()
    _, metrics = group_advantages(rewards, torch.ones(2), 4, "group")
    assert copies.calls == ["tolist"]
    _same({k: metrics[k] for k in want_rewards}, want_rewards)
    assert 0 <= metrics["frac_reward_zero_std"] <= 1
    copies.calls.clear()
    out = stats.metrics(beta=0.0)
    assert copies.calls == ["tolist"]
    for k, v in want_stats.items():
        assert out[k] == v, k
