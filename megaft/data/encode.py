"""Examples -> token ids plus a per-token loss mask."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from tokenizers import Tokenizer

from megaft.data.errors import DataError
from megaft.data.formats import is_chat


class Encoded(NamedTuple):
    """One tokenized example.

    `target[i]` says whether token i is a prediction target, i.e. whether the
    loss counts predicting `ids[i]` from the tokens before it. `target[0]` is
    always False: nothing in the example precedes it, and in a packed stream
    this keeps an example's first token from being "predicted" from the end of
    the unrelated previous example.

    `prompt_len` is the number of leading tokens every target needs in view
    (the prompt of a prompt/completion example; 0 for text, whose tokens are
    worth predicting from any amount of context). Packing drops the targets of
    an example whose prompt a window cut off.
    """

    ids: list[int]
    target: list[bool]
    prompt_len: int = 0


def encode_example(tok: Tokenizer, ex: dict, eos_id: Optional[int], chat: Any = None) -> Encoded:
    """Tokenize one example (a dict from `read_jsonl` or a generated task).

    conversations ({"messages"}, maybe "tools"): `chat.encode(messages, tools)`, `chat` being the run's
    megaft.data.chat.ChatEncoder (its template decides the tokens and the mask;
    nothing is appended). Without one, a DataError says how to get a template.

    text: `ids = tok.encode(text).ids` exactly as the tokenizer gives them,
    special tokens included as its post-processor adds them (e.g. Llama's BOS)
    and nothing appended; every token after the first is a target. Plain text
    is treated as a document to continue, so no EOS is forced onto it.

    prompt/completion: `tok.encode(prompt).ids` (with the post-processor's
    special tokens, so a BOS starts the prompt) + `tok.encode(completion,
    add_special_tokens=False).ids` + `[eos_id]` when eos_id is not None. Only
    the completion tokens and the EOS are targets, so the model learns to
    answer and to stop, and is never trained to produce prompts. The two parts
    are tokenized separately so the mask boundary is exact; put any separating
    space in the completion (" Paris"), as HF chat/SFT data usually does.
    """
    if is_chat(ex):
        return _encode_chat(chat, ex)
    first = tok.encode(ex["text"] if "text" in ex else ex["prompt"]).ids
    answer = None if "text" in ex else tok.encode(ex["completion"], add_special_tokens=False).ids
    return _assemble(first, answer, eos_id)


def encode_examples(tok: Tokenizer, examples: list[dict], eos_id: Optional[int],
                    chat: Any = None) -> list[Encoded]:
    """`encode_example` over a list, in order; text and prompt/completion examples
    are batched through `encode_batch` (the tokenizers library parallelizes it),
    with identical results."""
    plain = [i for i, ex in enumerate(examples) if not is_chat(ex)]
    firsts = tok.encode_batch([examples[i]["text"] if "text" in examples[i] else examples[i]["prompt"]
                               for i in plain])
    pcs = [i for i in plain if "text" not in examples[i]]
    answers = {i: enc.ids for i, enc in zip(pcs, tok.encode_batch(
        [examples[i]["completion"] for i in pcs], add_special_tokens=False))}
    out: list[Optional[Encoded]] = [None] * len(examples)
    for i, f in zip(plain, firsts):
        out[i] = _assemble(f.ids, answers.get(i), eos_id)
    for i, ex in enumerate(examples):
        if out[i] is None:
            out[i] = _encode_chat(chat, ex)
    return out


def _encode_chat(chat: Any, ex: dict) -> Encoded:
    if chat is None:
        raise DataError("a conversation needs a chat template, and the run has none; fix: set "
                        "data.chat_template to llama3, chatml or a .jinja file, or use a checkpoint "
                        "whose tokenizer_config.json has a chat_template")
    return chat.encode(ex["messages"], ex.get("tools"))


def _assemble(first: list[int], answer: Optional[list[int]], eos_id: Optional[int]) -> Encoded:
    """Join text (answer None) or prompt + completion ids and build the mask."""
    if answer is None:
        return Encoded(first, [i > 0 for i in range(len(first))])
    if eos_id is not None:
        answer = answer + [eos_id]
    target = [False] * len(first) + [True] * len(answer)
    if target:
        target[0] = False  # an empty prompt: the first token has nothing to be predicted from
    return Encoded(first + answer, target, len(first))
