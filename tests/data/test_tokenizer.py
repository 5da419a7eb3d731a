"""Tokenizers: the character tokenizer, loading files, special ids."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from megaft.data.errors import DataError
from megaft.data.tokenizer import char_tokenizer, load_tokenizer, special_ids


def test_char_tokenizer_one_id_per_char_and_decode_without_spaces():
    tok = char_tokenizer("0123456789+=")
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<eos>") == 1
    ids = tok.encode("12+3=").ids
    assert ids == [tok.token_to_id(c) for c in "12+3="]
    # Ids follow the alphabet's order after <pad>, <eos>, <unk>.
    assert ids == [3 + "0123456789+=".index(c) for c in "12+3="]
    assert tok.decode(ids) == "12+3="
    # Special tokens are dropped by decode (skip_special_tokens defaults to True).
    assert tok.decode(ids + [1, 0, 0]) == "12+3="
    assert tok.get_vocab_size() == 3 + 12


def test_char_tokenizer_keeps_spaces_and_newlines_and_maps_unknown_to_unk():
    tok = char_tokenizer("ab \n")
    text = "a b\nba"
    assert len(tok.encode(text).ids) == len(text)
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("azb").ids == [tok.token_to_id(t) for t in ("a", "<unk>", "b")]


def test_char_tokenizer_round_trips_through_save_and_from_file(tmp_path):
    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz=")
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    for loaded in (Tokenizer.from_file(path), load_tokenizer(path), load_tokenizer(str(tmp_path))):
        assert loaded.get_vocab() == tok.get_vocab()
        assert loaded.encode("hello=").ids == tok.encode("hello=").ids
        assert loaded.decode(loaded.encode("hello=").ids) == "hello="
        assert special_ids(loaded) == (1, 0)


def test_load_tokenizer_errors_name_the_file(tmp_path):
    missing = str(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match=rf"^{missing}: tokenizer file not found; fix: "):
        load_tokenizer(missing)
    with pytest.raises(DataError, match=rf"^{missing}: tokenizer file not found"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=rf"^{bad}: cannot load tokenizer .*; fix: "):
        load_tokenizer(str(bad))


def word_tokenizer(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_special_ids():
    # Explicit id (an HF config.json's eos_token_id) wins; no <pad>: pad = eos.
    tok = word_tokenizer(["<unk>", "</s>", "<|endoftext|>", "a"])
    assert special_ids(tok, eos_token_id=2) == (2, 2)
    # Candidates in order: "</s>" before "<|endoftext|>".
    assert special_ids(tok) == (1, 1)
    assert special_ids(word_tokenizer(["<unk>", "a", "<|end_of_text|>"])) == (2, 2)
    assert special_ids(word_tokenizer(["<unk>", "<|endoftext|>", "<pad>"])) == (1, 2)
    # Neither eos nor pad: (None, 0).
    assert special_ids(word_tokenizer(["<unk>", "a"])) == (None, 0)
    assert special_ids(word_tokenizer(["<unk>", "<pad>"])) == (None, 1)


def test_special_ids_takes_the_first_of_an_eos_list():
    """Llama 3.1's config.json lists several eos ids; the first is appended to completions."""
    tok = char_tokenizer("ab")
    assert special_ids(tok, [7, 8, 9])[0] == 7
    assert special_ids(tok, 5)[0] == 5
    assert special_ids(tok, [])[0] == tok.token_to_id("<eos>")
