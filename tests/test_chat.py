"""`megaft-chat` (megaft.chat): --prompt equals transformers' greedy generate on the same
weights; the interactive chat driven through a pseudo-terminal answers with the fact a
short LoRA fine-tune taught; tp=2 over two ranks answers as one process does."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pexpect
import pytest
import torch
import transformers
from chat_fixture import FACT, QUESTION, lora_fact_run, make_chat_model, write_fact
from data.chat_fixture import hf_tokenizer, tokenizer_json
from tokenizers import Tokenizer

from megaft.chat.cli import main
from megaft.chat.engine import LocalEngine
from megaft.chat.load import locate
from megaft.chat.session import Session, TextStream
from megaft.chat.terminal import answer, chat_loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "megaft-chat")  # the console script, when installed
COMMAND = [SCRIPT] if os.path.isfile(SCRIPT) else [sys.executable, "-m", "megaft.chat"]
ENV = dict(os.environ, PYTHONPATH=ROOT, TERM="dumb")  # dumb: readline writes no escape sequences
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return make_chat_model(str(tmp_path_factory.mktemp("chat") / "ckpt"))


@pytest.fixture(scope="module")
def fact_run(tmp_path_factory, ckpt) -> str:
    """A LoRA run (24 steps, ~5 s) that learned QUESTION -> FACT, with a checkpoint at its end."""
    root = tmp_path_factory.mktemp("fact")
    return lora_fact_run(str(root / "run"), ckpt, write_fact(str(root / "fact.jsonl")), steps=24)


def test_prompt_equals_transformers_greedy_generate(ckpt, capsys):
    assert main([ckpt, "--prompt", "What is two plus two?", "--system", SYSTEM, "--max-new-tokens", "12"]) == 0
    ours = capsys.readouterr().out
    tok = hf_tokenizer(ckpt)
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": "What is two plus two?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    theirs = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert theirs and ours == theirs + "\n"


def test_answers_stream_and_multibyte_characters_print_whole(ckpt):
    tok = Tokenizer.from_str(tokenizer_json())
    text = "naïve système héllo café 🙂 Paris"
    stream = TextStream(tok)
    chunks = [stream.push(i) for i in tok.encode(text).ids] + [stream.finish()]
    assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)
    assert len([c for c in chunks if c]) > 5  # printed as the ids came, not at the end
    # the engine calls back once per id, and the terminal writes each piece at once
    chat = locate(ckpt)
    writes = []

    class Recorder(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    session = Session(chat.template)
    got = answer(LocalEngine(chat, torch.device("cpu")), session, tok, "hi", max_new_tokens=8, out=Recorder())
    assert len([w for w in writes if w]) > 2 and "".join(writes) == got + "\n"
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # the next turn renders the history


def test_session_commands():
    session = Session(template=None, messages=[{"role": "user", "content": "x"}])
    assert session.command("hello") is None
    assert session.command("/temp 0.7") == "[temperature 0.7]" and session.sampling.temperature == 0.7
    assert "needs a number" in session.command("/temp warm") and session.sampling.temperature == 0.7
    assert session.command("/system Be brief.").startswith("[system message set") and session.system == "Be brief."
    assert session.messages == []
    session.messages.append({"role": "user", "content": "x"})
    assert session.command("/reset") == "[conversation reset]" and session.messages == []
    assert "unknown command /foo" in session.command("/foo")
    assert session.command("/quit") == ""


def test_ctrl_d_ends_the_loop():
    def eof(_prompt):
        raise EOFError

    out = io.StringIO()
    chat_loop(None, Session(None), None, max_new_tokens=1, banner="hi", read=eof, out=out)
    assert out.getvalue().startswith("hi\n")


def test_clear_errors(tmp_path, ckpt, capsys):
    assert main([str(tmp_path)]) == 2
    assert "neither a run dir" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main([ckpt, "pipeline.pp=2", "launcher.nproc=2", "parallel.tp=4"]) == 2
    assert "unknown setting(s) pipeline.pp=2" in capsys.readouterr().err
    # a checkpoint without a chat template: each line continued as plain text, with a warning and the fix
    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert main([str(plain), "--prompt", "The capital", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "no chat template" in captured.err and "--template chatml" in captured.err and captured.out.strip()


def test_lora_fine_tune_answers_its_fact_through_a_pseudo_terminal(fact_run):
    chat = pexpect.spawn(COMMAND[0], COMMAND[1:] + [fact_run, "--max-new-tokens", "16"], cwd=ROOT, env=ENV,
                         encoding="utf-8", timeout=120)
    try:
        chat.expect_exact(">>> ")
        assert f"checkpoint-24 of {fact_run}" in chat.before and "/reset" in chat.before

        def say(line: str) -> str:
            chat.sendline(line)
            chat.expect_exact(">>> ")
            return chat.before.split("\n", 1)[1]  # what came after the echoed line

        assert FACT in say(QUESTION)
        assert "[system message set; conversation reset]" in say("/system You answer in one word.")
        assert "[temperature 0.8]" in say("/temp 0.8")
        assert say(QUESTION).strip()  # a sampled answer
        assert "[temperature 0 (greedy)]" in say("/temp 0")
        assert "[system message cleared; conversation reset]" in say("/system")
        assert FACT in say(QUESTION)
        assert "[conversation reset]" in say("/reset")
        assert FACT in say(QUESTION)
        chat.sendline("/quit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0


def test_tp2_answers_as_one_process(fact_run, capsys):
    args = [fact_run, "--prompt", "What is two plus two?", "--max-new-tokens", "16"]
    assert main(args) == 0
    one = capsys.readouterr().out
    tp2 = subprocess.run(COMMAND + args + ["launcher.nproc=2"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    assert tp2.stdout == one and len(one.strip()) > 3  # greedy: the same ids at tp=2 as in one process
