"""LoRA on multi-head latent attention (DeepSeek-V3, megaft.models.attention.mla): its projections are
q_a_proj/q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj, so the attention
targets q, k, v of lora.targets' default name nothing there (only o would adapt). validate()
refuses them before launch, and apply_lora refuses a model built without validate(), each
naming what is wrong and the targets to use; q stays valid where the queries have one q_proj."""
from __future__ import annotations

import pytest
from models.deepseek_fixture import make_hf_deepseek

from lora.lora_fixture import lora_config, megaft_lora_model, write_data
from megaft.config import Config
from megaft.config.lora import check_lora_model
from megaft.peft.lora import adapters
from megaft.validation import validate

MODEL = dict(tie_embeddings=False, kv_heads=4, tp=1)


def test_check_lora_model_names_the_idle_mla_targets_and_the_fix():
    [problem] = check_lora_model(lora_config(), **MODEL, mla=True, q_latent=True)  # the default targets
    assert "['q', 'k', 'v']" in problem and "multi-head latent attention" in problem
    assert "q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj" in problem and "not targets" in problem
    assert problem.endswith("fix: lora.targets=[o,gate,up,down]")
    [problem] = check_lora_model(lora_config(), **MODEL, mla=True, q_latent=False)  # one q_proj: q adapts it
    assert "['k', 'v']" in problem and problem.endswith("fix: lora.targets=[q,o,gate,up,down] (q adapts q_proj)")
    [problem] = check_lora_model(lora_config(targets=["k"]), **MODEL, mla=True, q_latent=True)
    assert problem.endswith("fix: lora.targets=[o,gate,up,down]")  # nothing left: a working set
    assert check_lora_model(lora_config(targets=["o", "gate"]), **MODEL, mla=True, q_latent=True) == []
    assert check_lora_model(lora_config(targets=["q", "o"]), **MODEL, mla=True, q_latent=False) == []
    assert check_lora_model(lora_config(), **MODEL) == []  # grouped-query attention: q, k, v are its own
    assert check_lora_model(lora_config(rank=0), **MODEL, mla=True, q_latent=True) == []  # LoRA off


@pytest.mark.parametrize("variant", ["latent_q", "plain_q"])
def test_mla_models_refuse_the_default_targets(tmp_path, variant):
    ckpt = str(tmp_path / variant)
    make_hf_deepseek(ckpt, variant)
    cfg = Config()
    cfg.model.init_from, cfg.data.path = ckpt, write_data(tmp_path / "train.jsonl")
    cfg.data.seq_len, cfg.lora = 16, lora_config()
    problems = validate(cfg, 1)
    assert any("multi-head latent attention" in p and "fix: lora.targets=" in p for p in problems), problems
    good = ["q", "o", "gate", "up", "down"] if variant == "plain_q" else ["o", "gate", "up", "down"]
    cfg.lora = lora_config(targets=good)
    assert validate(cfg, 1) == []
    # the Python API, without validate(): the same message
    with pytest.raises(ValueError, match="multi-head latent attention.*fix: lora.targets="):
        megaft_lora_model(ckpt, lora_config())
    model = megaft_lora_model(ckpt, lora_config(targets=good))
    leaves = {name.rpartition(".")[2] for name, _ in adapters(model)}
    assert "o_proj" in leaves and ("q_proj" in leaves) == (variant == "plain_q")
