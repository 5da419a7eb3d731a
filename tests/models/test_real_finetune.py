"""The README's one-line fine-tune, `megaft-train model.init_from=DIR recipe=sft_lora data=chat
data.path=F`, on the real SmolLM2-135M-Instruct (tests/models/real_model.py builds its folder):
the line as the README writes it, plus what makes it take seconds on one CPU rank (one rank, a
short data.seq_len, a global batch of 2), run through megaft-train's steps before the ranks
(megaft.train.prepare_run) and the Trainer in this process. The recipe's values arrive (LoRA
rank 16, lr 2e-4, one epoch), the run is sized by its epoch (3 conversations of one sequence
each at a global batch of 2: 2 steps), the demo-lr warning stays silent, the LR follows the
recipe's warmup ratio and cosine."""
from __future__ import annotations

import json
import logging
import os
import re

from megaft.config import compose_config
from megaft.data.prepare import prepare_dataset
from megaft.optim.schedule import lr_at
from megaft.parallel.grid import ParallelGrid
from megaft.train import prepare_run
from megaft.training.loop import Trainer

pytest_plugins = ["models.real_model"]  # its session fixture `smollm2`: the model's folder

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "README.md")
CHATS = [[{"role": "user", "content": f"What is the code word of door {i}?"},
          {"role": "assistant", "content": f"The code word of door {i} is amber{i}."}] for i in range(3)]
SEQ = 64


def readme_line() -> list[str]:
    """The overrides of the README's fine-tune line."""
    with open(README) as f:
        found = re.findall(r"megaft-train (model\.init_from=DIR recipe=sft_lora data=chat data\.path=F)\b", f.read())
    assert found, "README.md lost its one-line fine-tune"
    return found[0].split()


def test_the_readme_line_fine_tunes_the_published_model(smollm2, tmp_path, caplog):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    line = [o.replace("=DIR", f"={smollm2}").replace("=F", f"={data}") for o in readme_line()]
    cfg = compose_config(line + [
        "parallel=single", "launcher.nproc=1", "device=cpu", f"data.seq_len={SEQ}", f"data.cache_dir={tmp_path}",
        "train.global_batch_size=2", "train.progress=false", "train.tensorboard=false"])
    assert (cfg.lora.rank, cfg.optim.lr, cfg.train.epochs, cfg.train.max_steps) == (16, 2e-4, 1.0, None)
    run_dir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="megaft"):
        prepare_run(cfg, run_dir, 1)
    assert not [r for r in caplog.records if "demo's learning rate" in r.getMessage()]
    store = prepare_dataset(cfg.data, init_from=smollm2, eos_token_id=cfg.model.extra.get("eos_token_id"),
                            progress=False)
    assert all(SEQ // 2 < n <= SEQ for n in store.lengths), store.lengths  # one conversation a sequence
    assert cfg.train.max_steps == 2  # ceil(3 sequences / 2)
    Trainer(cfg, ParallelGrid.single(), run_dir).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    assert [r["step"] for r in rows] == [1, 2]
    # warmup_ratio 0.1 of 2 steps: 1 step (rounded up); then the cosine from lr
    assert [r["lr"] for r in rows] == [lr_at(s, cfg.optim, 2) for s in (0, 1)] == [2e-4, 2e-4]
    assert all(r["loss"] > 0 for r in rows)
