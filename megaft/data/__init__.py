"""Data: tokenizers, JSONL examples, loss masks, packing, eval batches, generated tasks.

The trainer's path through it:

    problems = check_data(cfg, init_from=...)          # once, in the launcher
    tok = build_tokenizer(cfg, init_from=...)
    eos_id, pad_id = special_ids(tok, eos_token_id)    # eos_token_id from an HF config.json
    train, eval_, task = load_examples(cfg)
    stream = PackedStream(encode_examples(tok, train, eos_id), cfg.seq_len, cfg.seed)
    input_ids, labels = stream.global_batch(step, global_batch_size)   # same on every rank
    batches = eval_batches(encode_examples(tok, eval_, eos_id), batch_size, pad_id)
"""

from megaft.data.batches import IGNORE_INDEX, PackedStream, count_targets, eval_batches
from megaft.data.config import DataConfig, Examples, build_tokenizer, check_data, load_examples
from megaft.data.encode import Encoded, encode_example, encode_examples
from megaft.data.errors import DataError
from megaft.data.jsonl import jsonl_problems, parse_example, read_jsonl
from megaft.data.tasks import TASKS, Task, TaskSpec, exact_match, make_task, task_tokenizer
from megaft.data.tokenizer import char_tokenizer, load_tokenizer, special_ids

__all__ = [
    "IGNORE_INDEX", "PackedStream", "count_targets", "eval_batches",
    "DataConfig", "Examples", "build_tokenizer", "check_data", "load_examples",
    "Encoded", "encode_example", "encode_examples",
    "DataError",
    "jsonl_problems", "parse_example", "read_jsonl",
    "TASKS", "Task", "TaskSpec", "exact_match", "make_task", "task_tokenizer",
    "char_tokenizer", "load_tokenizer", "special_ids",
]
