"""Chat templates and role masks, checked against transformers' apply_chat_template."""
import pytest
from tokenizers import Tokenizer

from megaft.data.chat import ChatEncoder, assistant_mask
from megaft.data.errors import DataError
from megaft.data.templates import BUILTIN, CHATML, LLAMA3, ChatTemplate, load_chat_template, special_tokens
from tests.data.chat_fixture import (
    CHATML_PLAIN,
    CONVERSATIONS,
    FEATURES,
    LLAMA3_META,
    QWEN,
    QWEN_PLAIN,
    hf_tokenizer,
    make_checkpoint,
    tokenizer_json,
)

MARKED = {"chatml": CHATML, "llama3": LLAMA3, "qwen": QWEN, "features": FEATURES}
# Templates without markers and the marked template whose mask the incremental rule must give.
PLAIN = {"chatml": (CHATML_PLAIN, CHATML), "llama3_meta": (LLAMA3_META, LLAMA3), "qwen": (QWEN_PLAIN, QWEN)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One checkpoint per template, and transformers' tokenizer of each."""
    out = {}
    for name, text in {**MARKED, **{f"plain_{k}": v[0] for k, v in PLAIN.items()}}.items():
        path = make_checkpoint(str(tmp_path_factory.mktemp(name)), text)
        out[name] = (path, hf_tokenizer(path))
    return out


def encoder(path, train_on="assistant"):
    return ChatEncoder(Tokenizer.from_str(tokenizer_json()), load_chat_template("auto", path), train_on)


@pytest.mark.parametrize("name", sorted(MARKED))
def test_tokens_and_assistant_mask_equal_transformers(ckpts, name):
    path, hf = ckpts[name]
    enc = encoder(path)
    assert enc.template.has_generation_markers
    for conv in CONVERSATIONS:
        want = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        got = enc.encode(conv)
        assert got.ids == want["input_ids"]
        # Target i = "predicting token i counts"; token 0 never is (nothing precedes it).
        assert got.target == [bool(m) and i > 0 for i, m in enumerate(want["assistant_masks"])]
        assert sum(got.target) > 0
        assert got.prompt_len == got.target.index(True)


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_text_equals_transformers_without_markers(ckpts, name):
    path, hf = ckpts[f"plain_{name}"]
    template = load_chat_template("auto", path)
    assert not template.has_generation_markers
    for conv in CONVERSATIONS:
        for gen in (False, True):
            assert template.render(conv, gen) == hf.apply_chat_template(conv, tokenize=False,
                                                                        add_generation_prompt=gen)


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_incremental_rule_gives_the_marked_templates_mask(ckpts, name):
    """Without markers, the rule (content + end-of-turn token, no header, no trailing newline)
    finds exactly the tokens transformers marks in the marked version of the same template."""
    plain_path, _ = ckpts[f"plain_{name}"]
    _, marked_hf = ckpts[{"llama3_meta": "llama3"}.get(name, name)]
    enc = encoder(plain_path)
    for conv in CONVERSATIONS:
        want = marked_hf.apply_chat_template(conv, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        got = enc.encode(conv)
        assert got.ids == want["input_ids"]
        assert got.target == [bool(m) and i > 0 for i, m in enumerate(want["assistant_masks"])]


def test_builtin_templates_render_the_text_of_the_originals(ckpts):
    """llama3/chatml built-ins (with markers) write Meta's and plain ChatML's text."""
    for builtin, original in (("llama3", "plain_llama3_meta"), ("chatml", "plain_chatml")):
        mine = load_chat_template(builtin, None)
        _, hf = ckpts[original]
        for conv in CONVERSATIONS:
            assert mine.render(conv) == hf.apply_chat_template(conv, tokenize=False)
    # Without a tokenizer_config.json, llama3 still starts with Llama 3's BOS.
    assert load_chat_template("llama3", None).render(CONVERSATIONS[0]).startswith("<|begin_of_text|>")


def test_train_on_all_and_last(ckpts):
    path, _ = ckpts["chatml"]
    conv = CONVERSATIONS[1]
    every = encoder(path, "assistant").encode(conv)
    last = encoder(path, "last").encode(conv)
    everything = encoder(path, "all").encode(conv)
    assert every.ids == last.ids == everything.ids
    assert everything.target == [i > 0 for i in range(len(every.ids))] and everything.prompt_len == 0
    # last: only the final assistant turn, which is a suffix of the assistant tokens.
    assert 0 < sum(last.target) < sum(every.target)
    assert all(e or not t for e, t in zip(every.target, last.target))
    first_last = last.target.index(True)
    assert last.target[first_last:] == every.target[first_last:]
    tok = Tokenizer.from_str(tokenizer_json())
    assert tok.decode([i for i, t in zip(last.ids, last.target) if t], skip_special_tokens=False) \
        == "naïve système<|im_end|>"


def test_the_end_of_turn_token_is_trained():
    tok = Tokenizer.from_str(tokenizer_json())
    for name, eot in (("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        enc = ChatEncoder(tok, load_chat_template(name, None)).encode(CONVERSATIONS[0])
        trained = [i for i, t in zip(enc.ids, enc.target) if t]
        assert trained[-1] == tok.token_to_id(eot)
        assert tok.decode(trained[:-1]) == "It is four."


def test_assistant_mask_overlap_rule():
    offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 12)]
    assert assistant_mask(offsets, [(3, 6), (10, 11)]) == [False, True, True, False, True]
    assert assistant_mask(offsets, []) == [False] * 5


def test_template_sources_and_errors(tmp_path):
    # tokenizer_config.json: a list of named templates uses "default"; chat_template.jinja wins.
    ckpt = make_checkpoint(str(tmp_path / "a"), [{"name": "tool_use", "template": "T"},
                                                 {"name": "default", "template": "D{{ bos_token }}"}])
    assert load_chat_template("auto", ckpt).render([]) == "D<|begin_of_text|>"
    assert special_tokens(ckpt)["eos_token"] == "<|im_end|>"  # an AddedToken dict
    (tmp_path / "a" / "chat_template.jinja").write_text("J")
    assert load_chat_template("auto", ckpt).text == "J"
    no_default = make_checkpoint(str(tmp_path / "b"), [{"name": "tool_use", "template": "T"}])
    with pytest.raises(DataError, match=r"tokenizer_config.json: chat_template lists templates "
                                        r"\['tool_use'\] but no 'default'; fix: "):
        load_chat_template("auto", no_default)
    assert load_chat_template("auto", make_checkpoint(str(tmp_path / "c"))) is None
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(DataError, match=rf"^{broken}: the chat template does not compile .*; fix: "):
        load_chat_template(str(broken), None)
    with pytest.raises(DataError, match=r"data.chat_template='nope' is neither auto.*; fix: "):
        load_chat_template("nope", None)
    assert sorted(BUILTIN) == ["chatml", "llama3"]


def test_render_failures_and_non_incremental_templates_raise_with_fix():
    tok = Tokenizer.from_str(tokenizer_json())
    picky = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}", "picky.jinja", {})
    with pytest.raises(DataError, match=r"picky.jinja failed to render .*user first.*; fix: "):
        ChatEncoder(tok, picky).encode([{"role": "assistant", "content": "x"}])
    # Rewrites the past: the last message is rendered differently from earlier ones.
    moody = ChatTemplate("{% for m in messages %}{{ m.content if loop.last else m.content | upper }}"
                         "{% endfor %}", "moody.jinja", {})
    with pytest.raises(DataError, match=r"moody.jinja does not render this conversation incrementally.*"
                                        r"fix: add \{% generation %\} markers"):
        ChatEncoder(tok, moody).encode(CONVERSATIONS[1])
    assert ChatEncoder(tok, moody, "all").encode(CONVERSATIONS[1]).ids  # train_on=all needs no spans
    with pytest.raises(DataError, match=r"data.train_on='some' is unknown; fix: "):
        ChatEncoder(tok, picky, "some")
