"""Tool-use conversations: the OpenAI/transformers form and ShareGPT's function_call/observation,
rendered by real checkpoints' templates (tests/data/tool_templates.py) exactly as transformers'
apply_chat_template(messages, tools=tools) renders them, with the assistant's calls and answers
trained and the tool results not; conversations that train nothing are counted and refused."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from megaft.data.chat import ChatEncoder
from megaft.data.errors import DataError
from megaft.data.formats import parse_record
from megaft.data.jsonl import read_jsonl
from megaft.data.sources import read_source, scan_file, source_files
from megaft.data.templates import load_chat_template
from megaft.data.untrained import UntrainedConversations
from tests.data.chat_fixture import hf_tokenizer, make_checkpoint, tokenizer_json
from tests.data.tool_templates import LLAMA31, MISTRAL_V03, QWEN25, QWEN25_MARKED

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "café, naïve"}},
                   "required": ["city"]}}}
TIME = {"name": "get_time", "description": "The time in a city",  # bare spec: megaft wraps it
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def call(name, args, id_="call00001"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


# Records as files hold them. Arguments as a JSON string (OpenAI's form) or an object; content null.
ONE_CALL = {"messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Paris"}')]},
    {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call00001", "name": "get_weather"},
    {"role": "assistant", "content": "It is 18 degrees in Paris."}], "tools": [WEATHER, TIME]}
PARALLEL = {"messages": [  # text with the calls, two calls, two results in a row (Llama 3.1 allows one call)
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        call("get_weather", {"city": "Paris"}), call("get_time", {"city": "Paris"}, "call00002")]},
    {"role": "tool", "content": "18", "tool_call_id": "call00001"},
    {"role": "tool", "content": "noon", "tool_call_id": "call00002"},
    {"role": "assistant", "content": "18 degrees at noon."}], "tools": json.dumps([WEATHER, TIME])}
MULTI_TURN = {"messages": [  # a call, then a later exchange without one
    {"role": "user", "content": "Time in Paris?"},
    {"role": "assistant", "tool_calls": [{"function": {"name": "get_time", "arguments": {"city": "Paris"}},
                                          "id": "call00003"}]},
    {"role": "tool", "content": "noon", "tool_call_id": "call00003"},
    {"role": "assistant", "content": "It is noon."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."}], "tools": [TIME]}
NO_TOOLS_LIST = {"messages": [  # calls without a tools list (the template's tool-free system prompt)
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})], "content": ""},
    {"role": "tool", "content": "18", "tool_call_id": "call00001"},
    {"role": "assistant", "content": "18."}]}

NO_SYSTEM = {**ONE_CALL, "messages": ONE_CALL["messages"][1:]}

# (template, conversations it accepts, what each trains: one string per assistant turn)
CASES = {
    "qwen25": (QWEN25, {
        "one_call": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                     "It is 18 degrees in Paris.<|im_end|>"],
        "parallel": ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
                     "<|im_end|>", "18 degrees at noon.<|im_end|>"],
        "multi_turn": ['<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                       "It is noon.<|im_end|>", "You are welcome.<|im_end|>"],
        "no_tools_list": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                          "<|im_end|>", "18.<|im_end|>"]}),
    "llama31": (LLAMA31, {
        "one_call": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                     "It is 18 degrees in Paris.<|eot_id|>"],
        "multi_turn": ['{"name": "get_time", "parameters": {"city": "Paris"}}<|eot_id|>', "It is noon.<|eot_id|>",
                       "You are welcome.<|eot_id|>"]}),
    # Mistral v0.3 writes the system prompt and the tools into the last user turn, which the
    # incremental rule cannot follow: its case has neither (see test_mistral_rewrites_need_markers).
    "mistral_v03": (MISTRAL_V03, {
        "no_system": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]'
                      "<|im_end|>", " It is 18 degrees in Paris.<|im_end|>"]}),
}
RECORDS = {"one_call": ONE_CALL, "parallel": PARALLEL, "multi_turn": MULTI_TURN, "no_tools_list": NO_TOOLS_LIST,
           "no_system": NO_SYSTEM}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for name, text in {**{k: v[0] for k, v in CASES.items()}, "qwen25_marked": QWEN25_MARKED}.items():
        path = make_checkpoint(str(tmp_path_factory.mktemp(name)), text)
        out[name] = (path, hf_tokenizer(path))
    return out


def encoder(path, train_on="assistant"):
    return ChatEncoder(Tokenizer.from_str(tokenizer_json()), load_chat_template("auto", path), train_on)


def trained_runs(enc):
    """The decoded text of every run of consecutive target tokens."""
    tok, runs, run = Tokenizer.from_str(tokenizer_json()), [], []
    for i, t in zip(enc.ids + [None], enc.target + [False]):
        if t:
            run.append(i)
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    return runs


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_conversations_give_transformers_text_and_tokens(ckpts, name):
    path, hf = ckpts[name]
    template, enc = load_chat_template("auto", path), encoder(path)
    for conv in CASES[name][1]:
        ex = parse_record(RECORDS[conv])
        messages, tools = ex["messages"], ex.get("tools")
        for gen in (False, True):
            assert template.render(messages, gen, tools=tools) == hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen), (name, conv, gen)
        want = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
        assert enc.encode(messages, tools).ids == list(want["input_ids"]), (name, conv)


@pytest.mark.parametrize("name", sorted(CASES))
def test_assistant_calls_and_answers_train_and_tool_results_do_not(ckpts, name):
    """The mask of templates without {% generation %} markers is megaft's incremental rule: each
    assistant turn's tokens are what rendering the conversation up to it adds after the generation
    prompt, trailing whitespace removed (megaft.data.chat). Tool results (role tool) are input."""
    path, _ = ckpts[name]
    for conv, want in CASES[name][1].items():
        ex = parse_record(RECORDS[conv])
        assert trained_runs(encoder(path).encode(ex["messages"], ex.get("tools"))) == want, (name, conv)
        # last: only the final answer; all: every token but the first.
        assert trained_runs(encoder(path, "last").encode(ex["messages"], ex.get("tools"))) == want[-1:]
        everything = encoder(path, "all").encode(ex["messages"], ex.get("tools"))
        assert everything.target == [i > 0 for i in range(len(everything.ids))]


def test_qwen25_mask_equals_transformers_on_the_marked_template(ckpts):
    """transformers' return_assistant_tokens_mask needs {% generation %}: on Qwen2.5 with markers
    (same text), its mask equals megaft's rule on the real template and megaft's marker path."""
    plain_path, plain_hf = ckpts["qwen25"]
    marked_path, marked_hf = ckpts["qwen25_marked"]
    assert not load_chat_template("auto", plain_path).has_generation_markers
    for conv, record in RECORDS.items():
        ex = parse_record(record)
        messages, tools = ex["messages"], ex.get("tools")
        assert marked_hf.apply_chat_template(messages, tools=tools, tokenize=False) == \
            plain_hf.apply_chat_template(messages, tools=tools, tokenize=False)
        want = marked_hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        mask = [bool(m) and i > 0 for i, m in enumerate(want["assistant_masks"])]
        for path in (plain_path, marked_path):
            got = encoder(path).encode(messages, tools)
            assert got.ids == list(want["input_ids"]) and got.target == mask, (conv, path)
            assert got.prompt_len == mask.index(True)


def test_mistral_rewrites_need_markers(ckpts):
    """Mistral v0.3 writes the system prompt and the tools into the last user turn, so with a system
    prompt, or tools and several user turns, an earlier turn's prompt is not a prefix of the whole:
    refused with the fix (markers, or train_on=all), never guessed."""
    path, hf = ckpts["mistral_v03"]
    for record in (ONE_CALL, MULTI_TURN):
        ex = parse_record(record)
        with pytest.raises(DataError, match=r"does not render this conversation incrementally.*fix: add "
                                            r"\{% generation %\} markers.*or set data.train_on=all"):
            encoder(path).encode(ex["messages"], ex["tools"])
        got = encoder(path, "all").encode(ex["messages"], ex["tools"])
        assert got.ids == list(hf.apply_chat_template(ex["messages"], tools=ex["tools"], tokenize=True,
                                                      return_dict=True)["input_ids"])


def test_sharegpt_function_call_form_reads_into_the_same_messages(ckpts):
    """LLaMA-Factory's ShareGPT tool form (its glaive_toolcall demo's shape): function_call = the
    assistant's call (JSON string), observation = the result, `tools` and `system` as strings."""
    sharegpt = {"conversations": [
        {"from": "human", "value": "What is the weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp": 18}'},
        {"from": "gpt", "value": "It is 18 degrees in Paris."}],
        "system": "You are a helpful assistant.", "tools": json.dumps([WEATHER["function"], TIME])}
    openai = parse_record(ONE_CALL)
    for m in openai["messages"]:  # ShareGPT carries no call ids or tool names
        for c in m.get("tool_calls", ()):
            c.pop("id")
        m.pop("tool_call_id", None), m.pop("name", None)
    assert parse_record(sharegpt) == openai
    # A list of calls in one function_call turn is one assistant turn with several calls.
    two = parse_record({"conversations": [
        {"from": "human", "value": "?"},
        {"from": "function_call", "value": json.dumps([{"name": "a", "arguments": {}},
                                                       {"name": "b", "arguments": '{"x": 1}'}])}]})
    assert two["messages"][1] == {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {}}},
        {"type": "function", "function": {"name": "b", "arguments": {"x": 1}}}]}
    path, hf = ckpts["qwen25"]
    got = encoder(path).encode(openai["messages"], openai["tools"])
    assert got.ids == list(hf.apply_chat_template(openai["messages"], tools=openai["tools"], tokenize=True,
                                                  return_dict=True)["input_ids"])


def test_accepted_variants_normalize_to_the_openai_form(tmp_path):
    ex = parse_record(ONE_CALL)
    assert ex["messages"][2] == {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})]}
    assert ex["messages"][3] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call00001",
                                 "name": "get_weather"}
    assert ex["tools"] == [WEATHER, {"type": "function", "function": TIME}]
    # Arguments as a string or an object, tools as a string or a list, a call without its wrapper:
    # the same conversation.
    variant = json.loads(json.dumps(ONE_CALL))
    variant["messages"][2]["tool_calls"] = [{"id": "call00001", "name": "get_weather", "arguments": {"city": "Paris"}}]
    variant["tools"] = json.dumps(variant["tools"])
    assert parse_record(variant) == ex
    # Null and empty mean absent; a chat without tools normalizes as before.
    plain = parse_record({"messages": [{"role": "user", "content": "hi", "tool_calls": None},
                                       {"role": "assistant", "content": "yo", "tool_calls": []}], "tools": []})
    assert plain == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    # Parquet: nested columns are null where a row's turn does not use them.
    rows = [ex, plain]
    table = pa.Table.from_pylist([{"messages": [{**m, "tool_calls": [{**c, "function": {
        **c["function"], "arguments": json.dumps(c["function"]["arguments"])}} for c in m.get("tool_calls") or []]
        or None} for m in r["messages"]], "tools": json.dumps(r.get("tools"))} for r in rows])
    pq.write_table(table, str(tmp_path / "t.parquet"))
    assert read_source(str(tmp_path / "t.parquet")) == [ex, plain]


BAD = [  # (record, fragment of the problem)
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [call("f", {})]}]},
     "'messages'[0] is a user turn with 'tool_calls'; fix: only assistant turns call tools"),
    ({"messages": [{"role": "assistant", "tool_calls": {"name": "f"}}]},
     "'messages'[0]: 'tool_calls' must be a list of calls, got dict; fix: "),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": {}}}]}]},
     "'messages'[0].tool_calls[0] has no function name; fix: "),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "'messages'[0].tool_calls[0] (function 'f') has no 'arguments'; fix: add \"arguments\": {...}"),
    ({"messages": [{"role": "assistant", "tool_calls": [call("f", "{city: Paris}")]}]},
     "(function 'f'): 'arguments' is a string but not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [call("f", [1, 2])]}]},
     "(function 'f'): 'arguments' must be a JSON object (argument name -> value), got list; fix: "),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "code_interpreter"}]}]},
     "has type 'code_interpreter'; fix: only function calls"),
    ({"messages": [{"role": "tool", "content": {"temp": 18}}]},
     "'messages'[0]: 'content' must be a string, got dict; fix: "),
    ({"messages": [{"role": "tool"}]}, "'messages'[0] has no 'content'; fix: add a \"content\" string to a tool "
                                       "turn (the call's result as a string)"),
    ({"messages": [{"role": "function", "content": "x"}]},
     "has unknown role 'function'; fix: use one of ['system', 'user', 'assistant', 'tool']"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "[{"}, "'tools' is a string but not JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}},
     "'tools' must be a list of function specs, got dict; fix: "),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"description": "no name"}]},
     "'tools'[0] is not a function spec (keys: 'description'); fix: "),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "parameters": "object"}]},
     "'tools'[0] (function 'f'): 'parameters' must be a JSON schema object, got str; fix: "),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get_weather(Paris)"}]},
     "'conversations'[1] is a function_call whose value is not JSON"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "[]"}]},
     "'conversations'[1] is a function_call whose value holds no call; fix: "),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": '{"name": "f"}'}]},
     "'conversations'[1] (function_call) (function 'f') has no 'arguments'; fix: "),
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "x"}], "system": "t"},
     "has both a 'system' string and a system turn; fix: keep one"),
    ({"conversations": [{"from": "tool_call", "value": "x"}]},
     "'conversations'[0] has unknown role 'tool_call'; fix: use one of ['assistant', 'function_call', 'gpt', "
     "'human', 'observation', 'system', 'tool', 'user']"),
]


def test_bad_tool_records_name_file_line_and_fix(tmp_path):
    path = tmp_path / "bad.jsonl"
    for record, fragment in BAD:
        path.write_text(json.dumps(ONE_CALL) + "\n\n" + json.dumps(record) + "\n")
        with pytest.raises(DataError) as err:
            read_jsonl(str(path))
        msg = str(err.value)
        assert msg.startswith(f"{path}:3: ") and fragment in msg and "; fix: " in msg, msg


def test_templates_that_never_read_tools_are_refused(ckpts):
    """The built-in chatml renders any role but never reads tool_calls or tools: it would train empty
    answers in place of the calls. Tool results alone (calls written as text) are fine."""
    tok = Tokenizer.from_str(tokenizer_json())
    chatml = ChatEncoder(tok, load_chat_template("chatml", None))
    ex = parse_record(NO_TOOLS_LIST)
    with pytest.raises(DataError, match=r"the conversation has tool calls, which the chat template chatml never "
                                        r"reads \(no 'tool_calls' in it\).*; fix: use the checkpoint's own"):
        chatml.encode(ex["messages"])
    with pytest.raises(DataError, match=r"has tools, which the chat template chatml never reads"):
        chatml.encode([{"role": "user", "content": "hi"}], [WEATHER])
    text_calls = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "<tool_call>f()</tool_call>"},
                  {"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}]
    assert trained_runs(chatml.encode(text_calls)) == ["<tool_call>f()</tool_call><|im_end|>", "1<|im_end|>"]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def tally(train_on, *paths):
    """What a reader feeds: every record of every file of the sources."""
    t = UntrainedConversations(train_on)
    for path in paths:
        for file in source_files(path):
            for line, ex, problem in scan_file(file):
                assert problem is None
                t.add(file, line, ex)
    return t


def test_conversations_without_an_assistant_turn_are_counted_and_warned(tmp_path):
    prompt_only = {"messages": [{"role": "user", "content": "hi"}]}
    tool_only = {"conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": "1"}]}
    a = write_jsonl(tmp_path / "a.jsonl", [ONE_CALL, prompt_only, {"text": "t"}, tool_only])
    b = write_jsonl(tmp_path / "b.jsonl", [prompt_only] * 3 + [MULTI_TURN])
    t = tally("assistant", a, b)
    assert t.total == 5 and t.counts() == {"conversations": 7, "conversations_without_assistant": 5}
    assert t.warning() == (
        f"5 of 7 conversations have no assistant turn, so data.train_on=assistant trains nothing on them (they "
        f"are kept, as input only): {a}:2, {a}:4, {b}:1, ...; fix: add the assistant's reply (role assistant, "
        "or ShareGPT from gpt/function_call) or drop them, or set data.train_on=all")
    assert t.problems(a, [a]) == [] and t.problems(b, [b]) == []  # each source trains something
    assert tally("last", a, b).total == 5
    assert tally("all", a, b).total == 0 and tally("all", a, b).warning() is None
    # The encoder counts them too (the in-memory path), and encodes them with no target.
    enc = ChatEncoder(Tokenizer.from_str(tokenizer_json()), load_chat_template("chatml", None))
    assert not any(enc.encode(prompt_only["messages"]).target) and enc.untrained == 1


def test_a_source_where_every_conversation_trains_nothing_is_an_error(tmp_path):
    prompts = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"}]}
               for i in range(4)]
    one = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    t = tally("assistant", one)
    assert t.problems(one, [one]) == [
        f"{one}: none of its 4 conversations has an assistant turn, so data.train_on=assistant trains nothing "
        "on it; fix: add the assistant's replies (role assistant, or ShareGPT from gpt/function_call), set "
        "data.train_on=all to train on every token, or remove the source"]
    assert tally("all", one).problems(one, [one]) == []
    # A directory source names its files; one record that trains (a text line) clears it.
    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "x.jsonl", prompts[:2])
    write_jsonl(d / "y.jsonl", prompts[2:])
    files = source_files(str(d))
    (problem,) = tally("assistant", str(d)).problems(str(d), files)
    assert problem.startswith(f"{d} ({files[0]}, {files[1]}): none of its 4 conversations has an assistant turn")
    write_jsonl(d / "z.jsonl", [{"text": "a document"}])
    assert tally("assistant", str(d)).problems(str(d), source_files(str(d))) == []


def test_prepare_warns_once_counts_and_refuses_a_source_that_trains_nothing(tmp_path, caplog):
    """The readers' wiring: megaft-prepare (the one process that prepares) logs one warning and
    records the count in the manifest; check_data and prepare refuse a source that trains nothing."""
    import logging

    from megaft.config.data import DataConfig, SourceConfig
    from megaft.data.checks import check_data
    from megaft.data.prepare import prepare_dataset

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), QWEN25)
    prompt_only = {"messages": [{"role": "user", "content": "hi"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [ONE_CALL, prompt_only, prompt_only, NO_SYSTEM] * 100)
    cfg = DataConfig(sources=[SourceConfig(data)], cache_dir=str(tmp_path / "cache"), prepare_workers=2)
    assert check_data(cfg, init_from=ckpt) == []
    with caplog.at_level(logging.WARNING, logger="megaft"):
        ds = prepare_dataset(cfg, init_from=ckpt, progress=False)
        assert [r.getMessage() for r in caplog.records] == [
            f"megaft-prepare: 200 of 400 conversations have no assistant turn, so data.train_on=assistant trains "
            f"nothing on them (they are kept, as input only): {data}:2, {data}:3, {data}:6, ...; fix: add the "
            "assistant's reply (role assistant, or ShareGPT from gpt/function_call) or drop them, or set "
            "data.train_on=all"]
        caplog.clear()
        prepare_dataset(cfg, init_from=ckpt, progress=False)  # the ready store: nothing to say
        assert caplog.records == []
    assert ds.manifest["counts"]["conversations_without_assistant"] == 200
    assert ds.manifest["counts"]["conversations"] == 400
    only = write_jsonl(tmp_path / "prompts.jsonl", [prompt_only] * 3)
    cfg.sources = [SourceConfig(only)]
    fix = (f"{only}: none of its 3 conversations has an assistant turn, so data.train_on=assistant trains nothing "
           "on it; fix: ")
    (problem,) = check_data(cfg, init_from=ckpt)
    assert problem.startswith(f"data.sources[0]: {fix}")
    with pytest.raises(DataError, match=r"cannot prepare the dataset:\n  " + fix.replace("(", r"\(")):
        prepare_dataset(cfg, init_from=ckpt, progress=False)
    cfg.train_on = "all"
    assert check_data(cfg, init_from=ckpt) == [] and len(prepare_dataset(cfg, init_from=ckpt, progress=False)) == 3
