"""Fine-tuning a Hugging Face checkpoint on JSONL through `megaft-train`, end to end:
tp=2 over 2 local ranks, step-0 eval loss equal to transformers', export reloadable."""
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
import transformers
from models.hf_fixture import make_hf_llama, write_char_tokenizer
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_LINES = ["hello world", "abc", "The quick brown fox 42", "Z"]


def reference_eval_loss(ckpt: str) -> float:
    """transformers' token-weighted next-token loss over the eval lines, one line one sequence
    (the checkpoint's own *ForCausalLM class; tests/models/test_moe_training.py uses it too)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    total, count = 0.0, 0
    with torch.no_grad():
        for line in EVAL_LINES:
            ids = torch.tensor([tok.encode(line).ids])
            logits = model(ids).logits[0, :-1]
            total += F.cross_entropy(logits.double(), ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def test_finetune_hf_checkpoint_on_jsonl(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    make_hf_llama(str(ckpt))
    write_char_tokenizer(str(ckpt))
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Q{i}", "completion": f"abc{i % 7}"}) + "\n" for i in range(64)))
    evalf = tmp_path / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"text": t}) + "\n" for t in EVAL_LINES))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megaft.train", f"hydra.run.dir={run}", "train.progress=false",
           f"model.init_from={ckpt}", "data=jsonl", f"data.path={train}", f"data.eval_path={evalf}",
           "data.seq_len=16", "train.max_steps=2", "train.micro_batch_size=4", "train.global_batch_size=8",
           "train.export_hf=true"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step0 = rows[0]
    assert step0["step"] == 0 and "eval_accuracy" not in step0  # file data defines no accuracy
    # fp32 forward in both; tp=2 reorders sums: 1e-5 relative.
    assert abs(step0["eval_loss"] - reference_eval_loss(str(ckpt))) <= 1e-5 * step0["eval_loss"]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    exported = run / "hf"
    assert (exported / "tokenizer.json").exists()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    original = transformers.LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    changed = [n for n, p in reloaded.state_dict().items() if not torch.equal(p, original.state_dict()[n])]
    assert changed, "two training steps should have changed the weights"
