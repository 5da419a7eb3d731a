"""The teacher checkpoint of train.objective=distill against the student (megaft.validation)."""
from __future__ import annotations

import os
from typing import Optional

from megaft.config.distill import DistillConfig
from megaft.models.checks import check_model

__all__ = ["check_prompts", "check_teacher", "check_top_k"]

SCANNED = 1000  # the lines of each source check_prompts reads


def _vocab(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path).get_vocab()


def check_teacher(cfg: DistillConfig, model, tp: int, tokenizer_dir: Optional[str]) -> list[str]:
    """The teacher directory against the resolved student `model` and its tokenizer directory:
    an HF checkpoint megaft reads, of the student's vocabulary and tokenizer, that splits over tp."""
    path = cfg.teacher
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return [f"distill.teacher={path} is not a Hugging Face checkpoint directory (no config.json); fix: point "
                "it at one (config.json, weights, tokenizer.json)"]
    from megaft.models.hf.config import hf_model_config

    try:
        teacher = hf_model_config(path, base=model)
    except (OSError, ValueError) as exc:
        return [f"distill.teacher: {exc}"]
    if teacher.vocab_size != model.vocab_size:
        return [f"distill.teacher={path} has a vocabulary of {teacher.vocab_size} tokens and the student "
                f"{model.vocab_size}: the divergence compares the two distributions token by token "
                "(cross-tokenizer distillation is not built); fix: a teacher of the student's tokenizer"]
    problems = [f"distill.teacher: {p}" for p in check_model(teacher, tp)]
    mine = os.path.join(tokenizer_dir, "tokenizer.json") if tokenizer_dir else None
    theirs = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(theirs):
        problems.append(f"distill.teacher={path} has no tokenizer.json, so its tokenizer cannot be checked against "
                        "the student's; fix: copy the teacher's tokenizer.json beside its config.json")
    elif mine is None or not os.path.isfile(mine):
        problems.append("distill: the student's tokenizer is not a tokenizer.json (data.tokenizer or "
                        "model.init_from), so the teacher's cannot be checked against it; fix: data.tokenizer=DIR "
                        "of the shared tokenizer")
    elif _vocab(mine) != _vocab(theirs):
        problems.append(f"distill.teacher={path}'s tokenizer maps tokens to other ids than the student's "
                        f"({mine}): token-by-token distillation would compare different tokens (cross-tokenizer "
                        "distillation is not built); fix: a teacher of the student's tokenizer")
    return problems


def check_top_k(top_k: int, *, vocab_size: int, pp: int, cp: int, packing: str) -> list[str]:
    """distill.top_k against the student's vocabulary and the layouts the stored teacher serves."""
    problems = []
    if top_k > vocab_size:
        problems.append(f"distill.top_k={top_k} exceeds the vocabulary ({vocab_size} tokens); fix: "
                        f"distill.top_k={vocab_size} (the whole vocabulary: the full divergence) or less")
    if packing == "stream":
        problems.append("distill.top_k scores each document once from its own start, and data.packing=stream "
                        "gives a token the context of the documents before it; fix: data.packing=docs or none")
    if pp > 1 or cp > 1:
        problems.append(f"distill.top_k is built for parallel.pp=1 and parallel.cp=1 (got pp={pp}, cp={cp}): the "
                        "stored rows are not yet passed through the pipeline schedule or the context shards; fix: "
                        "pp=1 and cp=1 (tp and dp are supported), or the online teacher (distill.top_k=null)")
    return problems


def check_prompts(paths: list[str], lines: int = SCANNED) -> list[str]:
    """distill.lmbda/seq_kd against the data: generated completions continue each example's prompt, and a plain
    text line has none (its prompt would be its first token). The first `lines` examples of each source."""
    from megaft.data.errors import DataError
    from megaft.data.sources import read_source

    for path in paths:
        try:
            examples = read_source(path, max_lines=lines)
        except (DataError, OSError):  # check_data reports the source's own problems
            continue
        text = next((n for n, ex in enumerate(examples, start=1) if "text" in ex), None)
        if text is not None:
            return [f"distill.lmbda/seq_kd sample completions of each example's prompt, and {path} holds plain "
                    f"text (example {text}), which has none; fix: prompt/completion or chat lines (the prompt: "
                    "the turns before the last assistant turn), or distill.lmbda=0 distill.seq_kd=false"]
    return []
