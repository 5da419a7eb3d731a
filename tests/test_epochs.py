"""train.epochs: resolved once before any rank starts into the steps it means, for every data
path and objective, against hand counts; written into config.yaml's derived.epochs; a restarted
run keeps the steps its config.yaml recorded (megaft.training.epochs).

The chat file holds 7 conversations of 40 tokens each (asserted on the prepared store): at
data.seq_len=64 no two fit one sequence, so packing=docs makes 7 sequences an epoch, and
train.epochs=2 at a global batch of 4 is ceil(14 / 4) = 4 steps."""
from __future__ import annotations

import json
import math

import pytest
from chat_fixture import make_chat_model
from rl.grpo_cases import G, write_rollouts

from megaft.config import compose_config
from megaft.config.data import SourceConfig
from megaft.config.train import check_train
from megaft.data.prepare import prepare_dataset
from megaft.launch.score_jobs import scoring_config
from megaft.parallel.grid import ParallelGrid
from megaft.train import prepare_run
from megaft.training.loop import Trainer
from megaft.training.run_config import read_run_config
from megaft.verify.run import _for_verify

N, LENGTH, SEQ = 7, 40, 64


def conversations(n: int, first: int = 0) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"Question number {i}?"},
                                            {"role": "assistant", "content": f"Answer number {i}."}]}) + "\n"
                   for i in range(first, first + n))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny chat checkpoint (ChatML) and the chat file."""
    root = tmp_path_factory.mktemp("epochs")
    make_chat_model(str(root / "ckpt"))
    (root / "chat.jsonl").write_text(conversations(N))
    return root


def chat_config(root, *extra: str):
    """The README's chat fine-tune, sized in epochs, at one rank on CPU."""
    return compose_config([
        "parallel=single", "launcher.nproc=1", "device=cpu", f"model.init_from={root / 'ckpt'}", "data=chat",
        f"data.path={root / 'chat.jsonl'}", f"data.seq_len={SEQ}", f"data.cache_dir={root / 'prepared'}",
        "train.max_steps=null", "train.epochs=2", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.progress=false", "train.tensorboard=false", "train.eval_every=1000", "optim.lr=1e-3", *extra])


def resolved(cfg, run_dir) -> int:
    prepare_run(cfg, str(run_dir), 1)
    return cfg.train.max_steps


def test_the_conversations_are_as_long_as_the_hand_count_says(ckpt):
    cfg = chat_config(ckpt)
    store = prepare_dataset(cfg.data, init_from=cfg.model.init_from, eos_token_id=None, progress=False)
    assert store.lengths.tolist() == [LENGTH] * N and SEQ < 2 * LENGTH <= 2 * SEQ


@pytest.mark.parametrize("epochs, steps", [(2, 4), (1.5, 3), (0.1, 1), (3, 6)])
def test_chat_epochs_resolve_to_the_hand_counted_steps(ckpt, tmp_path, epochs, steps):
    # 7 sequences an epoch: 14 -> 4 steps (the last starts epoch 3), 10.5 -> 3, 0.7 -> 1, 21 -> 6
    assert resolved(chat_config(ckpt, f"train.epochs={epochs}"), tmp_path) == steps


def test_every_data_path_counts_its_unit(ckpt, tmp_path):
    # packing=none with data.long_docs=split at seq_len 16: ceil(40 / 16) = 3 pieces a conversation, 21 an epoch
    assert resolved(chat_config(ckpt, "data.packing=none", "data.seq_len=16", "train.epochs=1"), tmp_path / "a") == 6
    # a stream: 2 epochs of 7 * 40 tokens are 8.75 sequences of 64
    stream = chat_config(ckpt, "data.packing=stream")
    assert resolved(stream, tmp_path / "b") == math.ceil(2 * N * LENGTH / SEQ / 4) == 3
    # data.sources at weight 2: every conversation twice an epoch, 14 sequences -> ceil(28 / 4)
    mixed = chat_config(ckpt)
    mixed.data.path, mixed.data.sources = None, [SourceConfig(str(ckpt / "chat.jsonl"), 2.0)]
    assert resolved(mixed, tmp_path / "c") == 7


def test_pairs_and_completions(ckpt, tmp_path):
    # dpo: 5 pairs that fit and 1 whose prompt fills data.seq_len (dropped, as TRL drops it): 3 epochs of 5 pairs
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Question {i}?", "chosen": "Yes.", "rejected": "No."} for i in range(5)]
    rows.append({"prompt": "word " * 80, "chosen": "Yes.", "rejected": "No."})
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = chat_config(ckpt, "data=jsonl", f"data.path={pairs}", "train.objective=dpo", "train.epochs=3")
    assert resolved(dpo, tmp_path / "dpo") == math.ceil(3 * 5 / 4) == 4
    # grpo: 6 logged groups of G=4 completions; 1.5 passes = 36 completions at 8 a step
    rollouts = tmp_path / "rollouts.jsonl"
    with open(ckpt / "ckpt" / "config.json") as f:
        write_rollouts(str(rollouts), vocab=json.load(f)["vocab_size"])
    grpo = ["data.path=null", "data.packing=none", "train.objective=grpo", f"rl.rollouts={rollouts}",
            f"rl.num_generations={G}", "rl.max_completion_length=8", "data.seq_len=16", "train.epochs=1.5",
            f"train.global_batch_size={2 * G}", f"train.micro_batch_size={G}"]
    assert resolved(chat_config(ckpt, *grpo), tmp_path / "grpo") == math.ceil(1.5 * 6 * G / (2 * G)) == 5
    # rl.num_iterations=2: each batch trained twice (TRL's sampler repeats it), so a pass takes twice the steps
    mu2 = chat_config(ckpt, *grpo, "rl.num_iterations=2")
    assert resolved(mu2, tmp_path / "grpo_mu2") == math.ceil(2 * 1.5 * 6 * G / (2 * G)) == 9


def test_a_restarted_run_keeps_the_steps_its_config_recorded(ckpt, tmp_path):
    run = tmp_path / "run"
    cfg = chat_config(ckpt, "train.save_every=2")
    assert resolved(cfg, run) == 4
    Trainer(cfg, ParallelGrid.single(), str(run)).fit()
    ran = read_run_config(str(run))
    assert ran.config.train.epochs == 2 and ran.config.train.max_steps == 4
    with open(run / "config.yaml") as f:
        assert "epochs:\n    epochs: 2.0\n    global_batch_size: 4\n    max_steps: 4\n" in f.read()
    # the data grew: counted afresh, 2 epochs of 14 conversations would be 7 steps ...
    (ckpt / "more.jsonl").write_text(conversations(2 * N))
    grown = [f"data.path={ckpt / 'more.jsonl'}", "train.save_every=2"]
    assert resolved(chat_config(ckpt, *grown, "train.resume=false"), tmp_path / "fresh") == 7
    # ... but the restarted run keeps its 4 (the same epoch boundaries and LR schedule), and resumes at its end
    again = chat_config(ckpt, *grown)
    assert resolved(again, run) == 4
    summary = Trainer(again, ParallelGrid.single(), str(run)).fit()
    assert summary["steps"] == 4
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if '"loss"' in line] == [1, 2, 3, 4]
    # another epoch count (or global batch) is another run: counted afresh, 3 epochs of 14 sequences
    assert resolved(chat_config(ckpt, *grown, "train.epochs=3"), run) == math.ceil(3 * 2 * N / 4) == 11


def test_steps_and_epochs_are_one_or_the_other():
    cfg = compose_config([])
    t = cfg.train
    t.epochs = 2.0
    assert check_train(t, 1) == ["train.max_steps=250 and train.epochs=2.0 are both set (a recipe may set one); "
                                 "fix: null the other: train.max_steps=null to train for epochs, train.epochs=null "
                                 "for steps"]
    t.max_steps, t.epochs = None, None
    assert check_train(t, 1)[0].startswith("train.max_steps and train.epochs are both null")
    t.epochs = 0.0
    assert check_train(t, 1) == ["train.epochs=0.0 must be > 0; fix: e.g. train.epochs=1"]
    t.epochs = 0.5
    assert check_train(t, 1) == []
    with pytest.raises(ValueError, match="train.max_steps is unset"):
        Trainer(cfg, ParallelGrid.single(), "unused")
    # the tools that fix the steps (scoring: 0, megaft-verify: a few) drop a recipe's epochs
    for fixed in (scoring_config(cfg), _for_verify(cfg, 3)):
        assert fixed.train.epochs is None and check_train(fixed.train, 1) == []
