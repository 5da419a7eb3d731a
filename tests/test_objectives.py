"""train.objective chooses the data and step parts through one registry (megaft.training.objectives):
every name validation accepts is registered, each family's builders are its own, and an unknown
name is refused with the list."""
import pytest

from megaft.config import Config
from megaft.config.pref import OBJECTIVE_CHOICES
from megaft.training import parts
from megaft.training.objectives import REGISTRY, distill, grpo, objective_of, preference, reward, sft
from megaft.validation import check_settings


def test_the_registry_holds_exactly_the_objectives_validation_accepts():
    assert sorted(REGISTRY) == sorted(OBJECTIVE_CHOICES)
    assert objective_of("sft").build_data is sft.build_data and objective_of("sft").build_step is sft.build_step
    assert objective_of("grpo").build_data is grpo.build_data and objective_of("grpo").build_step is grpo.build_step
    assert (objective_of("reward").build_data, objective_of("reward").build_step) == \
        (reward.build_data, reward.build_step)
    # sft's data part (distill.build_data adds the stored teacher's rows under distill.top_k), distillation's step
    assert (objective_of("distill").build_data, objective_of("distill").build_step) == \
        (distill.build_data, distill.build_step)
    for name in set(OBJECTIVE_CHOICES) - {"sft", "grpo", "reward", "distill"}:
        assert (objective_of(name).build_data, objective_of(name).build_step) == \
            (preference.build_data, preference.build_step), name
    with pytest.raises(ValueError, match="train.objective='ppo' is unknown; fix: one of sft, dpo"):
        objective_of("ppo")
    cfg = Config()
    cfg.train.objective = "ppo"  # refused before any rank starts, naming the same choices
    assert any("train.objective='ppo' is unknown" in p for p in check_settings(cfg, 1))


def test_the_train_spec_asks_the_registry(monkeypatch):
    # TrainSpec's default data and step builders dispatch on train.objective, never on a branch of their own
    seen = []
    monkeypatch.setitem(REGISTRY, "sft", REGISTRY["sft"].__class__(
        "sft", lambda p: seen.append(("data", p.cfg.train.objective)) or "data part",
        lambda p: seen.append(("step", p.cfg.train.objective)) or "step part"))

    class Parts:
        cfg = Config()

    assert parts.build_data(Parts()) == "data part" and parts.build_step_part(Parts()) == "step part"
    assert seen == [("data", "sft"), ("step", "sft")]
