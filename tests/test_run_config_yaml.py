"""RUN_DIR/config.yaml's text is OmegaConf's for the same Config (megaft.training.run_config.config_yaml
writes it from the dataclasses without building OmegaConf's structured copy)."""
import pytest
from omegaconf import OmegaConf

from megaft.config import Config
from megaft.config.compose import compose_config
from megaft.training.run_config import config_yaml, load_config


def _omegaconf(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


@pytest.mark.parametrize("overrides", [[], ["recipe=sft_lora"], ["recipe=grpo", "train.objective=grpo"],
                                       ["model=1b", "parallel=tp2"], ["train.objective=dpo", "data=chat"]])
def test_the_text_is_omegaconfs(overrides):
    cfg = compose_config(overrides)
    assert config_yaml(cfg) == _omegaconf(cfg)


def test_ints_in_float_fields_enums_and_optional_lists_are_written_as_omegaconf_holds_them(tmp_path):
    cfg = Config()
    cfg.optim.clip_grad, cfg.optim.min_lr, cfg.rl.epsilon_high = 0, 0, 1  # float, Optional[float] fields
    cfg.rl.reward_weights, cfg.model.extra = [1, 2], {"a": 1, "b": [1, 2.5]}  # Optional[List[float]], Dict[str, Any]
    text = config_yaml(cfg)
    assert text == _omegaconf(cfg) and "clip_grad: 0.0" in text and "- 2.0\n" in text
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert load_config(str(path)) == OmegaConf.to_object(OmegaConf.structured(cfg))
