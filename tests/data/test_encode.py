"""Loss masks: which tokens are targets."""

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from megaft.data.encode import Encoded, encode_example, encode_examples
from megaft.data.tokenizer import char_tokenizer

TOK = char_tokenizer("0123456789+=abc ")
EOS = TOK.token_to_id("<eos>")


def ids(s):
    return [TOK.token_to_id(c) for c in s]


def test_prompt_completion_targets_only_completion_and_eos():
    enc = encode_example(TOK, {"prompt": "12+3=", "completion": "51"}, EOS)
    assert enc == Encoded(ids("12+3=51") + [EOS], [False] * 5 + [True] * 3, prompt_len=5)


def test_prompt_completion_without_eos_appends_nothing():
    enc = encode_example(TOK, {"prompt": "ab", "completion": "c"}, None)
    assert enc == Encoded(ids("abc"), [False, False, True], prompt_len=2)


def test_empty_prompt_keeps_first_token_untargeted():
    enc = encode_example(TOK, {"prompt": "", "completion": "ab"}, EOS)
    assert enc == Encoded(ids("ab") + [EOS], [False, True, True], prompt_len=0)


def test_text_targets_every_token_after_the_first_and_appends_nothing():
    enc = encode_example(TOK, {"text": "abc 12"}, EOS)
    assert enc == Encoded(ids("abc 12"), [False] + [True] * 5, prompt_len=0)


def bos_tokenizer():
    """A word tokenizer whose post-processor adds <s> in front, like Llama's."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "the", "capital", "is", "Paris"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def test_special_tokens_come_from_the_post_processor_on_prompt_and_text_only():
    tok = bos_tokenizer()
    enc = encode_example(tok, {"prompt": "the capital is", "completion": "Paris"}, 2)
    assert enc == Encoded([1, 3, 4, 5, 6, 2], [False, False, False, False, True, True], 4)
    enc = encode_example(tok, {"text": "the capital"}, 2)
    assert enc == Encoded([1, 3, 4], [False, True, True])


def test_encode_examples_matches_encode_example():
    tok = bos_tokenizer()
    examples = [{"text": "the capital"}, {"prompt": "the", "completion": "capital is"},
                {"prompt": "", "completion": ""}, {"text": ""}]
    assert encode_examples(tok, examples, 2) == [encode_example(tok, ex, 2) for ex in examples]
    assert encode_examples(TOK, [], EOS) == []
