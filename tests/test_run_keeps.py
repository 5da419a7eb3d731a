"""What a run keeps by default (megaft.config.keep): a checkpoint at its last step (train.save_every=0
too), the HF export of a run that started from a checkpoint (LoRA: the adapter and the merged model),
the demo's character tokenizer as a tokenizer.json transformers loads; a finished run run again stays
as it was."""
from __future__ import annotations

import json
import os

import pytest
from models.hf_fixture import make_hf_llama
from train_cases import small_config

from megaft.checkpoint import list_checkpoints
from megaft.config import Config
from megaft.config.keep import exports_hf
from megaft.data.tasks import TASKS, task_tokenizer
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve, validate


def _train(cfg: Config, run_dir: str) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    return Trainer(cfg, ParallelGrid.single(), run_dir).fit()


def _demo() -> Config:
    """make train's task (conf/data/reverse.yaml) on the small model, 2 steps."""
    cfg = small_config(steps=2)
    cfg.data.task, cfg.model.vocab_size = "reverse", 0
    return resolve(cfg)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("demo"))
    cfg = _demo()
    assert cfg.train.save_every == 0 and not exports_hf(cfg)
    _train(cfg, run_dir)
    return run_dir


def test_the_demo_keeps_its_last_step_and_its_tokenizer(demo):
    from transformers import PreTrainedTokenizerFast

    assert [s for s, _ in list_checkpoints(os.path.join(demo, "checkpoints"))] == [2]
    assert not os.path.exists(os.path.join(demo, "hf"))  # a seeded init: no export unless asked
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(demo, "tokenizer.json"))
    want = task_tokenizer(TASKS["reverse"]).encode("abcd=").ids
    assert hf("abcd=")["input_ids"] == want and hf.decode(want) == "abcd="


def test_a_finished_run_run_again_stays_as_it_was(demo):
    with open(os.path.join(demo, "summary.json")) as f:
        before = json.load(f)
    result = _train(_demo(), demo)
    with open(os.path.join(demo, "summary.json")) as f:
        assert json.load(f) == before
    assert result["final_loss"] == before["final_loss"] is not None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    make_hf_llama(path, seed=1)
    return path


def _from(ckpt: str, **train) -> Config:
    cfg = small_config(steps=1)
    cfg.model.init_from, cfg.data.seq_len, cfg.train.eval_every = ckpt, 16, 1000
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return resolve(cfg)


def test_a_fine_tune_of_a_checkpoint_exports_unless_told_not_to(ckpt, tmp_path):
    _train(_from(ckpt), str(tmp_path / "auto"))
    assert os.path.isfile(tmp_path / "auto" / "hf" / "model.safetensors")
    _train(_from(ckpt, export_hf=False), str(tmp_path / "off"))
    assert not os.path.exists(tmp_path / "off" / "hf")
    assert [s for s, _ in list_checkpoints(str(tmp_path / "off" / "checkpoints"))] == [1]


def test_a_lora_fine_tune_exports_the_adapter_and_the_merged_model(ckpt, tmp_path):
    cfg = _from(ckpt)
    cfg.lora.rank = 2
    assert validate(cfg, 1) == []
    _train(cfg, str(tmp_path))
    assert os.path.isfile(tmp_path / "hf" / "adapter_config.json")
    assert os.path.isfile(tmp_path / "hf_merged" / "model.safetensors")


def test_what_a_run_keeps_is_validated(ckpt):
    zero3 = _from(ckpt)
    zero3.parallel.zero = 3
    assert not exports_hf(zero3)  # auto leaves out the export ZeRO-3 cannot write (the checkpoint stays)
    zero3.train.export_hf = True
    assert any("parallel.zero=3 does not support train.export_hf" in p for p in validate(zero3, 2))
    cfg = _from(ckpt, export_hf=False)
    cfg.lora.rank, cfg.lora.export_merged = 2, True
    assert any("lora.export_merged=true writes with the export" in p for p in validate(cfg, 1))


def test_chat_answers_as_transformers_with_the_runs_settings(demo):
    """megaft-chat RUN_DIR exports the final checkpoint and answers greedily as transformers' generate
    does on that export; it takes the run's precision and kernels, --dtype overrides."""
    import torch
    from transformers import AutoModelForCausalLM

    from megaft.chat.engine import LocalEngine
    from megaft.chat.load import locate
    from megaft.inference.generate import Sampling
    from megaft.training.run_config import read_run_config

    run = read_run_config(demo).config
    chat = locate(demo)
    assert (chat.dtype, chat.kernels, chat.routing) == (str(run.precision), run.kernels, run.moe)
    assert locate(demo, dtype="bf16").dtype == "bf16"
    prompt = [2 + 1 + i for i in range(4)]  # any ids of the character vocabulary
    ours = LocalEngine(chat, torch.device("cpu")).answer(prompt, Sampling(), 0, 6, lambda t: None)
    hf = AutoModelForCausalLM.from_pretrained(chat.hf_dir, torch_dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=list(chat.stop_ids),
                       pad_token_id=0)[0, len(prompt):].tolist()
    # the same ids; megaft's answer leaves out the eos that ended it
    assert want == ours or (want[:len(ours)] == ours and want[len(ours)] in chat.stop_ids), (ours, want)


def test_eval_reads_a_run_in_its_precision(demo):
    from megaft.config.eval import EvalConfig
    from megaft.eval.model_dir import Target
    from megaft.eval.run import eval_dtype

    target = Target(hf_dir=demo, out_dir=demo, run_dir=demo, origin="checkpoint-2")
    assert eval_dtype(target, EvalConfig()) == "float32"  # the demo's precision
    assert eval_dtype(target, EvalConfig(dtype="bfloat16")) == "bfloat16"
    assert eval_dtype(Target(demo, demo, None, "folder"), EvalConfig()) == "auto"
