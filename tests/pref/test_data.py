"""Preference pairs against TRL: for every record form, megaft.pref.data's token ids equal the
prompt_ids / chosen_ids / rejected_ids of TRL's DPOTrainer (trl 1.16 tokenizes in
`DPOTrainer._prepare_dataset`; it is called here on a stand-in trainer, which is all it reads),
its texts equal TRL's maybe_extract_prompt + maybe_apply_chat_template, and its truncation
equals TRL's max_length filter + DataCollatorForPreference. Bad records are named by FILE:LINE."""
import json
import logging
import os
import types

import datasets
import pytest
from tokenizers import Tokenizer, processors
from trl.data_utils import extract_prompt as trl_extract_prompt
from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

from megaft.data.errors import DataError
from megaft.data.templates import load_chat_template
from megaft.pref.data import (
    Pair,
    encode_pair,
    extract_prompt,
    pair_problems,
    parse_pair,
    read_pairs,
    render_pair,
    truncate,
)
from tests.data.chat_fixture import LLAMA3_META, QWEN_PLAIN, hf_tokenizer, make_checkpoint, tokenizer_json

datasets.disable_progress_bars()

# ChatML whose generation prompt opens an empty thought block that the full conversation lacks (as
# Qwen3 / Gemma write it): the rendered prompt is not a prefix of prompt + completion.
THINK = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
         "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
         "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}")


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]

# One file per form: TRL decides the form (prompt extraction, EOS) from a dataset's first row.
FORMS = {
    "standard": [
        {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."},
        # The space ends the prompt: byte-level BPE merges it into the completion's first token, so
        # the tokenized prompt is not a prefix of prompt + chosen (TRL's common-prefix rule).
        {"prompt": "What is two plus two? ", "chosen": "It is four.", "rejected": "It is five."},
        # An empty prompt; a rejected answer that already ends with the EOS text gets no second one.
        {"prompt": "", "chosen": "héllo café", "rejected": "naïve système<|im_end|>"},
    ],
    "standard_implicit": [
        # The space before the first difference goes to the completions.
        {"chosen": "The capital of France is Paris.", "rejected": "The capital of France is Lyon."},
        # One is a prefix of the other: TRL's loop leaves the last shared character to both.
        {"chosen": "two plus two is four", "rejected": "two plus two is four, or five"},
    ],
    "conversational": [
        {"prompt": [user("What is two plus two?")], "chosen": [assistant("It is four.")],
         "rejected": [assistant("It is five.")]},
        {"prompt": [SYSTEM, user("The capital of France?"), assistant(" Paris \n"), user("héllo <b>&café</b> 🙂")],
         "chosen": [assistant("naïve système")], "rejected": [assistant(" Lyon \n")]},
        {"prompt": [user("two")], "chosen": [assistant("four"), assistant("It is four.")],
         "rejected": [assistant("five")]},
    ],
    "conversational_implicit": [
        {"chosen": [user("What is two plus two?"), assistant("It is four.")],
         "rejected": [user("What is two plus two?"), assistant("It is five.")]},
        {"chosen": [SYSTEM, user("two"), assistant("four"), user("France"), assistant("Paris")],
         "rejected": [SYSTEM, user("two"), assistant("four"), user("France"), assistant("Lyon")]},
    ],
}
TOOL_FORM = [{"prompt": [user("What is two plus two?")], "chosen": [assistant("It is four.")],
              "rejected": [assistant("It is five.")], "tools": json.dumps(TOOLS)}]  # TRL json.loads a string


def bos_tokenizer_json() -> str:
    """The fixture's tokenizer with a post-processor that starts every text with <|begin_of_text|>."""
    tok = Tokenizer.from_str(tokenizer_json())
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (megaft tokenizer, megaft template, transformers tokenizer)."""
    out = {}
    for name, template, tok_json in (("qwen", QWEN_PLAIN, tokenizer_json()),
                                     ("llama3_bos", LLAMA3_META, bos_tokenizer_json()),
                                     ("think", THINK, tokenizer_json())):
        path = make_checkpoint(str(tmp_path_factory.mktemp(name)), template)
        Tokenizer.from_str(tok_json).save(os.path.join(path, "tokenizer.json"))
        out[name] = (Tokenizer.from_str(tok_json), load_chat_template("auto", path), hf_tokenizer(path))
    return out


def write(tmp_path, records, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def trl_dataset(records, hf, max_length=None):
    """TRL's tokenized dataset: DPOTrainer._prepare_dataset reads only self._tokenizer and these args."""
    trainer = types.SimpleNamespace(_tokenizer=hf)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    return DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records), hf, args, "train")


CASES = [(c, f) for c in ("qwen", "llama3_bos", "think") for f in FORMS] + [("qwen", "tools")]


@pytest.mark.parametrize("ckpt,form", CASES)
def test_ids_equal_trl_dpo_trainer(ckpts, tmp_path, ckpt, form):
    tok, template, hf = ckpts[ckpt]
    records = TOOL_FORM if form == "tools" else FORMS[form]
    pairs = read_pairs(write(tmp_path, records), tok, template)
    want = trl_dataset(records, hf)
    assert len(pairs) == len(want) == len(records)
    for pair, row in zip(pairs, want):
        assert pair == Pair(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
        assert pair.chosen_ids and pair.rejected_ids and pair.chosen_ids != pair.rejected_ids
    if ckpt == "llama3_bos":  # one BOS: the tokenizer's for text, the template's for conversations
        bos = tok.token_to_id("<|begin_of_text|>")
        assert all(p.prompt_ids[0] == bos and p.prompt_ids.count(bos) == 1 for p in pairs)
    if form.startswith("standard"):  # TRL appends the EOS text to text completions, once
        eos = tok.token_to_id("<|im_end|>")
        assert all(p.chosen_ids[-1] == eos and p.rejected_ids[-1] == eos for p in pairs)
        assert all(p.rejected_ids.count(eos) == 1 for p in pairs)


@pytest.mark.parametrize("ckpt", ["qwen", "llama3_bos", "think"])
def test_texts_equal_trl_maybe_apply_chat_template(ckpts, ckpt):
    _, template, hf = ckpts[ckpt]
    for form, records in {**FORMS, "tools": TOOL_FORM}.items():
        if form == "tools" and ckpt != "qwen":
            continue
        for rec in records:
            trl_rec = {k: v for k, v in rec.items() if k != "tools"}
            tools = json.loads(rec["tools"]) if "tools" in rec else None
            want = maybe_apply_chat_template(maybe_extract_prompt(trl_rec), hf, tools=tools)
            assert render_pair(parse_pair(rec), template) == (want["prompt"], want["chosen"], want["rejected"])


def test_the_prompt_cut_where_trl_cuts_it_is_logged(ckpts, tmp_path, caplog):
    # THINK's prompt alone ends with the thought block; the pair's prompt stops before it.
    tok, template, _ = ckpts["think"]
    path = write(tmp_path, FORMS["conversational"])
    with caplog.at_level(logging.WARNING, logger="megaft.pref.data"):
        pairs = read_pairs(path, tok, template)
    rendered = template.render(FORMS["conversational"][0]["prompt"], add_generation_prompt=True)
    assert len(pairs[0].prompt_ids) < len(tok.encode(rendered, add_special_tokens=False).ids)
    assert f"{path}: in 3 of 3 pairs (first: line 1)" in caplog.text
    caplog.clear()
    tok, template, _ = ckpts["qwen"]  # ChatML writes the prompt alike in both: nothing to report
    with caplog.at_level(logging.WARNING, logger="megaft.pref.data"):
        read_pairs(path, tok, template)
    assert caplog.text == ""


@pytest.mark.parametrize("chosen,rejected", [
    ("The sky is blue.", "The sky is green."),
    ("two plus two is four", "two plus two is four, or five"),
    ("abc", "abd"),
    ("a b", "a c"),
    ([user("q"), assistant("a")], [user("q"), assistant("b")]),
    ([user("q"), assistant("a")], [user("q"), assistant("a"), user("r"), assistant("b")]),
    ([SYSTEM, user("q"), assistant("a")], [SYSTEM, user("q2"), assistant("a")]),
])
def test_extract_prompt_equals_trl(chosen, rejected):
    want = trl_extract_prompt({"chosen": chosen, "rejected": rejected})
    assert extract_prompt(chosen, rejected) == (want["prompt"], want["chosen"], want["rejected"])


@pytest.mark.parametrize("max_length", [3, 45, 52, 1024])
def test_truncate_equals_trl_filter_and_collator(ckpts, max_length):
    tok, template, hf = ckpts["qwen"]
    records = FORMS["conversational"] + FORMS["conversational_implicit"]
    pairs = [encode_pair(parse_pair(r), tok, template) for r in records]
    kept = [p for p in (truncate(p, max_length) for p in pairs) if p is not None]
    # One TRL dataset per form (TRL reads the form off the first row); each drops the pairs whose
    # prompt has max_length tokens or more.
    want = [row for form in ("conversational", "conversational_implicit")
            for row in trl_dataset(FORMS[form], hf, max_length=max_length)]
    assert len(kept) == len(want)
    if not kept:
        assert max_length <= min(len(p.prompt_ids) for p in pairs)
        return
    batch = DataCollatorForPreference(pad_token_id=0, max_length=max_length)(want)
    n = len(kept)
    for i, pair in enumerate(kept):
        for row, completion in ((i, pair.chosen_ids), (n + i, pair.rejected_ids)):
            length = int(batch["attention_mask"][row].sum())
            assert batch["input_ids"][row, :length].tolist() == pair.prompt_ids + completion
            assert batch["completion_mask"][row].tolist()[:length] == [0] * len(pair.prompt_ids) + [1] * len(completion)
            assert length <= max_length
    if max_length in (45, 52):  # prompts of 41 to 61 tokens: some pairs dropped, some completions cut
        assert 0 < len(kept) < len(pairs)
        assert sum(map(len, (c for p in kept for c in (p.chosen_ids, p.rejected_ids)))) < sum(
            len(c) for p in pairs if len(p.prompt_ids) < max_length for c in (p.chosen_ids, p.rejected_ids))


def test_truncate_keeps_everything_without_a_limit():
    pair = Pair([1, 2], [3, 4, 5], [6])
    assert truncate(pair, None) is pair
    assert truncate(pair, 4) == Pair([1, 2], [3, 4], [6])
    assert truncate(pair, 2) is None


# (line, fragment of the problem, fragment of its fix)
BAD = [
    ('{"prompt": "a", "chosen": "b"', "invalid JSON", "one complete JSON object per line"),
    ('["a", "b"]', "expected a JSON object, got list", "write each pair as"),
    ('{"prompt": "a", "chosen": "b"}', "has no 'rejected' (keys: 'prompt', 'chosen')", "write each pair as"),
    ('{"prompt": "a", "rejected": "b", "completion": "c"}', "has no 'chosen'", "write each pair as"),
    ('{"prompt": "a", "chosen": 3, "rejected": "b"}', "'chosen' must be a string or a list of turns, got int",
     "write each pair as"),
    ('{"prompt": 3, "chosen": "a", "rejected": "b"}', "'prompt' must be a string or a list of turns, got int",
     "write each pair as"),
    ('{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}',
     "'chosen' is a string but 'rejected' a conversation", "both as strings or both as lists of turns"),
    ('{"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}', "'prompt' is a string but", "list of turns, or drop it"),
    ('{"prompt": "a", "chosen": "", "rejected": "b"}', "'chosen' is empty", "non-empty chosen and rejected"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": [{"role": "assistant", '
     '"content": "b"}]}', "'chosen' is an empty conversation", "at least one turn"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": ""}, {"role": "assistant", "content": ""}]}',
     "'rejected' is empty (its assistant turns have no content", "non-empty chosen and rejected"),
    ('{"prompt": "q", "chosen": "same", "rejected": "same"}', "'chosen' and 'rejected' are the same",
     "different rejected answer"),
    ('{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
     "'chosen' and 'rejected' are the same", "different rejected answer"),
    ('{"chosen": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]}',
     "share no leading turns", 'add a "prompt", or start chosen and rejected with the same prompt turns'),
    ('{"chosen": "Paris.", "rejected": "Lyon."}', "share no leading characters", "same prompt text"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}',
     "'chosen'[0] is a user turn, but the completion 'chosen' must hold only assistant turns", "put the conversation"),
    ('{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, '
     '{"role": "user", "content": "r"}, {"role": "assistant", "content": "b"}]}',
     "'rejected'[2] is a user turn", "differ only in the assistant's answer"),
    ('{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
     '"chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}',
     "the prompt's last turn is 'assistant'", "end the prompt with a user (or tool) turn"),
    ('{"prompt": [{"role": "bot", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}', "'prompt'[0] has unknown role 'bot'", "use one of"),
    ('{"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}', "'prompt'[0] has no 'content'", 'add a "content"'),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}], "tools": 5}', "'tools' must be a list of function specs",
     '"tools": ['),
]


@pytest.mark.parametrize("line,problem,fix", BAD)
def test_bad_record_names_file_line_problem_and_fix(ckpts, tmp_path, line, problem, fix):
    tok, template, _ = ckpts["qwen"]
    good = json.dumps(FORMS["standard"][0])
    path = write(tmp_path, [good, "", line, good])  # the bad record is on line 3
    with pytest.raises(DataError) as err:
        read_pairs(path, tok, template)
    msg = str(err.value)
    assert msg.startswith(f"{path}:3: ")
    assert problem in msg
    head, _, tail = msg.partition("; fix: ")
    assert fix in tail and problem in head
    assert pair_problems(path) == [msg]


def test_bad_bytes_missing_and_empty_files(ckpts, tmp_path):
    tok, template, _ = ckpts["qwen"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(FORMS["standard"][0]).encode() + b'\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=rf"^{bad}:2: not valid UTF-8 .*; fix: re-encode the file as UTF-8"):
        read_pairs(str(bad), tok, template)
    empty = write(tmp_path, ["", "  "], "empty.jsonl")
    with pytest.raises(DataError, match=rf"^{empty}: no pairs .*; fix: add at least one line"):
        read_pairs(empty, tok, template)
    missing = str(tmp_path / "nope.jsonl")
    assert pair_problems(missing) == [f"{missing}: file not found; fix: check the path (relative paths are "
                                      "resolved from the directory the run starts in)"]


def test_problems_lists_every_bad_line_then_a_count(tmp_path):
    lines = [json.dumps(FORMS["standard"][0])] + ['{"chosen": "a"}'] * 5
    path = write(tmp_path, lines)
    problems = pair_problems(path, limit=3)
    assert [p.split(": ")[0] for p in problems[:3]] == [f"{path}:{n}" for n in (2, 3, 4)]
    assert problems[3] == f"{path}: 2 more malformed lines not shown"


def test_what_encoding_needs_is_named_with_its_line(ckpts, tmp_path):
    tok, template, _ = ckpts["qwen"]
    conv = write(tmp_path, [FORMS["conversational"][0]], "conv.jsonl")
    with pytest.raises(DataError, match=rf"^{conv}:1: a conversational pair needs a chat template.*; fix: set "
                                        "data.chat_template"):
        read_pairs(conv, tok)
    text = write(tmp_path, [FORMS["standard"][0]], "text.jsonl")
    with pytest.raises(DataError, match=rf"^{text}:1: a text pair needs the tokenizer's eos_token.*; fix: give"):
        read_pairs(text, tok)
    # An explicit eos_token stands in for the template's; the ids then equal those with the template.
    assert read_pairs(text, tok, eos_token="<|im_end|>") == read_pairs(text, tok, template)
    _, llama, _ = ckpts["llama3_bos"]  # Meta's template never reads `tools`
    tools = write(tmp_path, TOOL_FORM, "tools.jsonl")
    with pytest.raises(DataError, match=rf"^{tools}:1: the pair has tools, which the chat template .* never "
                                        "reads.*; fix: use the checkpoint's own template"):
        read_pairs(tools, tok, llama)
    strict = template._replace(text="{{ raise_exception('only user turns') }}")
    with pytest.raises(DataError, match=rf"^{conv}:1: the chat template .* failed to render this pair "
                                        r"\(TemplateError: only user turns\); fix: correct the conversation"):
        read_pairs(conv, tok, strict)
