"""Tokenizers: everything is a `tokenizers.Tokenizer` (HF `tokenizers` library).

HF checkpoints ship a tokenizer.json; the generated tasks use a character-level
tokenizer built with the same library, so the trainer and the decoding code
never need to know which kind they hold.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from megaft.data.errors import DataError

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# End-of-sequence spellings of the common model families, tried in this order.
EOS_CANDIDATES = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>")


def tokenizer_file(path: str) -> str:
    """The tokenizer.json a path names: the file itself, or `path/tokenizer.json`
    when `path` is a directory (an HF checkpoint)."""
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer.json (or an HF checkpoint directory holding one).

    Raises DataError naming the file when it is missing or cannot be parsed.
    """
    file = tokenizer_file(path)
    if not os.path.isfile(file):
        raise DataError(f"{file}: tokenizer file not found; fix: point data.tokenizer "
                        "at a tokenizer.json or an HF checkpoint directory holding one")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"{file}: cannot load tokenizer ({e}); fix: use a tokenizer.json "
                        "saved by the HF `tokenizers` library") from e


def char_tokenizer(alphabet: str) -> Tokenizer:
    """A character-level tokenizer: one token per character of `alphabet`.

    Ids: `<pad>`=0, `<eos>`=1, `<unk>`=2 (characters outside the alphabet), then
    the alphabet's characters in order (duplicates dropped). It adds no special
    tokens when encoding, and `decode` joins characters without separators (the
    Fuse decoder) and drops the special tokens, so `decode(encode(s).ids) == s`
    for any `s` over the alphabet.
    """
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # `[\s\S]` rather than `.` so newlines become tokens too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Registered as special so that decode(skip_special_tokens=True) drops them.
    tok.add_special_tokens([PAD, EOS, UNK])
    return tok


def special_ids(tok: Tokenizer, eos_token_id: Union[int, list[int], None] = None) -> tuple[Optional[int], int]:
    """`(eos_id, pad_id)` for a tokenizer.

    eos: `eos_token_id` when given (an HF config.json's; Llama 3.1 lists several, and
    the first, <|end_of_text|>, is the one appended to completions), else the first of
    EOS_CANDIDATES the vocabulary holds, else None. pad: `<pad>` when present,
    else eos, else 0; padding is always masked out of the loss, so any id works.
    """
    if isinstance(eos_token_id, (list, tuple)):
        eos_token_id = eos_token_id[0] if eos_token_id else None
    eos = eos_token_id
    if eos is None:
        eos = next((i for i in map(tok.token_to_id, EOS_CANDIDATES) if i is not None), None)
    pad = tok.token_to_id(PAD)
    if pad is None:
        pad = eos if eos is not None else 0
    return eos, pad
