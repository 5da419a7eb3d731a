"""pref.scores' fingerprint (megaft.pref.scores) covers what the reference numbers depend on:
the chat template's text (an edited .jinja file, or one beside the tokenizer, rescores) and
the resolved model config (a model.* override on top of init_from rescores); an unchanged
setup reads the stored scores."""
from __future__ import annotations

import glob

from models.hf_fixture import make_hf_llama

from megaft.data.templates import CHATML
from megaft.parallel.grid import ParallelGrid
from megaft.pref.scores import fingerprint
from megaft.training.summary import RunSummary
from megaft.validation import resolve, validate
from pref.pref_train_cases import pref_config, run, write_pairs


def test_an_edited_template_or_a_model_override_rescores(tmp_path):
    ckpt, pairs, template = str(tmp_path / "ckpt"), str(tmp_path / "pairs.jsonl"), tmp_path / "t.jinja"
    make_hf_llama(ckpt, seed=1)
    write_pairs(pairs, n=4)
    template.write_text(CHATML)
    store = str(tmp_path / "scores")

    def dpo(name: str, **model) -> bool:
        """Runs one step; whether it scored (rather than read the store)."""
        cfg = pref_config(ckpt, pairs, "dpo", steps=1)
        cfg.pref.scores, cfg.data.chat_template = store, str(template)
        for key, value in model.items():
            setattr(cfg.model, key, value)
        assert validate(cfg, 1) == []
        run(resolve(cfg), ParallelGrid.single(), str(tmp_path / name))
        return RunSummary.read(str(tmp_path / name)).reference_s is not None

    assert dpo("first")
    assert not dpo("again")  # unchanged: read
    template.write_text(CHATML + "\n")  # the same setting, another text
    assert dpo("edited")
    assert dpo("override", dropout=0.1)  # a model.* override on top of init_from
    assert len(glob.glob(f"{store}/reference-*.safetensors")) == 3
    assert not dpo("recompute", dropout=0.1, recompute="full")  # memory, not numbers: read


def test_the_template_beside_the_tokenizer_is_fingerprinted(tmp_path):
    """data.chat_template=auto reads the checkpoint's chat_template.jinja: editing it changes the key,
    and the launcher's unresolved config keys like the run's resolved one."""
    ckpt, pairs = str(tmp_path / "ckpt"), str(tmp_path / "pairs.jsonl")
    make_hf_llama(ckpt, seed=1)
    write_pairs(pairs, n=4)
    beside = tmp_path / "ckpt" / "chat_template.jinja"
    beside.write_text(CHATML)
    cfg = pref_config(ckpt, pairs, "dpo")
    cfg.pref.scores = str(tmp_path / "scores")
    before = fingerprint(cfg)
    assert fingerprint(resolve(pref_config(ckpt, pairs, "dpo"))) == fingerprint(pref_config(ckpt, pairs, "dpo"))
    beside.write_text(CHATML.replace("<|im_start|>", "<|im_start|> "))
    assert fingerprint(cfg) != before
