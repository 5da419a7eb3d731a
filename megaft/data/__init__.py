"""Data: tokenizers, JSONL examples, loss masks, packing, eval batches, generated tasks.

The trainer's path through it:

    problems = check_data(cfg, init_from=...)          # once, in the launcher
    tok = build_tokenizer(cfg, init_from=...)
    eos_id, pad_id = special_ids(tok, eos_token_id)    # eos_token_id from an HF config.json
    train, eval_, task = load_examples(cfg)
    stream = PackedStream(encode_examples(tok, train, eos_id), cfg.seq_len, cfg.seed)
    input_ids, labels = stream.global_batch(step, global_batch_size)   # same on every rank
    batches = eval_batches(encode_examples(tok, eval_, eos_id), batch_size, pad_id)

Fine-tuning data (issue 12): conversations, sources, the prepared store, packing
that keeps documents apart:

    ds = prepare_dataset(cfg, init_from=..., eos_token_id=...)   # memory-mapped; prepared once
    if cfg.packing == "stream":
        stream = PackedStream(ds.to_encoded(weights, cfg.seed), cfg.seq_len, cfg.seed)
    else:                                                       # docs | none
        stream = PackedDocs(ds, cfg.seq_len, cfg.seed, pad_id=pad_id, packing=cfg.packing,
                            long_docs=cfg.long_docs, weights=[s.weight for s in data_sources(cfg)])
    input_ids, labels = stream.global_batch(step, n)
    batch = stream.doc_batch(step, n)    # + position_ids, doc_ids, cu_seqlens of the same rows
    chat = chat_encoder(cfg, tok, init_from=...)                # in-memory: encode_examples(..., chat=chat)
"""

from megaft.config.data import DataConfig, SourceConfig, data_sources
from megaft.data.batches import IGNORE_INDEX, PackedStream, count_targets, eval_batches
from megaft.data.build import Examples, build_tokenizer, chat_encoder, load_examples
from megaft.data.checks import check_data
from megaft.data.encode import Encoded, encode_example, encode_examples
from megaft.data.errors import DataError
from megaft.data.formats import parse_record
from megaft.data.jsonl import jsonl_problems, parse_example, read_jsonl
from megaft.data.packed import DocBatch, EncodedCorpus, PackedDocs, cu_seqlens, document_mask
from megaft.data.plan import EpochPlan, epoch_plan, first_fit
from megaft.data.sources import mixture, read_source, source_files
from megaft.data.store import PreparedDataset
from megaft.data.tasks import TASKS, Task, TaskSpec, exact_match, make_task, task_tokenizer
from megaft.data.tokenizer import char_tokenizer, load_tokenizer, special_ids

__all__ = [
    "IGNORE_INDEX", "PackedStream", "count_targets", "eval_batches",
    "DataConfig", "Examples", "build_tokenizer", "chat_encoder", "check_data", "data_sources", "load_examples",
    "Encoded", "encode_example", "encode_examples",
    "DataError",
    "parse_record", "jsonl_problems", "parse_example", "read_jsonl",
    "DocBatch", "EncodedCorpus", "PackedDocs", "cu_seqlens", "document_mask",
    "EpochPlan", "epoch_plan", "first_fit",
    "SourceConfig", "mixture", "read_source", "source_files",
    "PreparedDataset", "prepare_dataset",
    "TASKS", "Task", "TaskSpec", "exact_match", "make_task", "task_tokenizer",
    "char_tokenizer", "load_tokenizer", "special_ids",
]


def prepare_dataset(*args, **kwargs):
    """megaft.data.prepare.prepare_dataset (imported on use: it pulls in jinja2 and multiprocessing)."""
    from megaft.data.prepare import prepare_dataset as prepare

    return prepare(*args, **kwargs)
