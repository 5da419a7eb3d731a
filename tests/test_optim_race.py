"""benchmarks.optim_race's arithmetic (issue 41): the trailing-mean smoothing, the best lr per
optimizer, the target (the best AdamW run's final smoothed loss) and the first step at which each
best run reaches it, on hand-made curves whose answers are known. The race itself needs minutes of
training per run (docs/optimizers.md has its output), too long for the suite."""
import pytest

from benchmarks.optim_race import first_reaching, race, smooth


def test_smooth_is_a_trailing_mean():
    assert smooth([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert smooth([4.0, 2.0, 6.0], 5) == [4.0, 3.0, 4.0]  # fewer steps at the start


def test_first_reaching():
    assert first_reaching([3.0, 2.0, 1.0, 2.0], 2.0) == 2  # 1-based, at or below
    assert first_reaching([3.0, 2.5], 2.0) is None


def test_race_picks_each_best_lr_and_the_adamw_target():
    curves = {("adamw", 1e-3): [5.0, 4.0, 3.0, 2.5], ("adamw", 3e-3): [5.0, 3.0, 2.5, 2.0],
              ("muon", 1e-2): [5.0, 2.0, 1.5, 1.0], ("muon", 3e-2): [5.0, 4.0, 4.0, 4.0]}
    out = race(curves, window=1)
    assert out["best"] == {"adamw": ("adamw", 3e-3), "muon": ("muon", 1e-2)}
    assert out["target"] == 2.0 and out["steps"] == {"adamw": 4, "muon": 2}
    out = race(curves, window=2)  # smoothed: adamw 3e-3 ends at 2.25, muon 1e-2 passes it at step 3 (1.75)
    assert out["target"] == pytest.approx(2.25) and out["steps"] == {"adamw": 4, "muon": 3}
