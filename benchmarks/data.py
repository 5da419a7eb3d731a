"""Preparing chat data: throughput, rank start-up on the ready cache, resident memory.

    python -m benchmarks.data                 # 64 MB of generated conversations, 2 workers
    python -m benchmarks.data --mb 1024       # the issue's 1 GB case

Prints, against references measured in the same process:
- prepare throughput with --workers processes (render the chat template, tokenize,
  write the store) over one process calling the `tokenizers` library directly on
  the same conversations (json.loads + encode_batch of the joined turns, no template);
- start-up of a training rank on the ready cache: open the memory-mapped store,
  plan epoch 0 (first-fit) and build the first global batch (target < 2 s);
- anonymous resident memory of such a rank with the dataset versus a 1 MB one (target:
  < 50 MB more); the store's mapped pages are page cache shared by a node's ranks.
Runs on CPU; the numbers depend on the machine, so compare ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had "
         "by word but not what all were we when your can said there use an each which she do how their if "
         "will up other about out many then them these so some her would make like him into time has look two "
         "more write go see number no way could people my than first water been call who oil its now find").split()


def generate(path: str, megabytes: int, seed: int = 0) -> int:
    """A JSONL file of `megabytes` MB of 2-6 turn conversations; returns its record count."""
    rng, n, size = random.Random(seed), 0, 0
    with open(path, "w") as f:
        while size < megabytes << 20:
            turns = [{"role": "system", "content": "You are a helpful assistant."}]
            for t in range(rng.randint(2, 6)):
                words = rng.choices(WORDS, k=rng.randint(10, 150))
                turns.append({"role": "user" if t % 2 == 0 else "assistant", "content": " ".join(words)})
            line = json.dumps({"messages": turns}) + "\n"
            f.write(line)
            size, n = size + len(line), n + 1
    return n


def checkpoint(path: str) -> None:
    """A byte-level BPE tokenizer with the ChatML tokens, and no template of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))


def direct_tokenize(path: str, tokenizer: str) -> float:
    """Seconds for one process to json.loads every line and encode_batch the turns."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    start = time.perf_counter()
    with open(path) as f:
        batch = []
        for line in f:
            batch.append("\n".join(m["content"] for m in json.loads(line)["messages"]))
            if len(batch) == 1024:
                tok.encode_batch(batch, add_special_tokens=False)
                batch = []
        tok.encode_batch(batch, add_special_tokens=False)
    return time.perf_counter() - start


RANK = """
import os, sys, time
def rss():  # anonymous resident bytes: the rank's own memory, without mapped file pages
    line = [l for l in open("/proc/self/status") if l.startswith("RssAnon:")][0]
    return int(line.split()[1]) * 1024
t0 = time.perf_counter()
from megaft.data import PackedDocs, PreparedDataset
t1 = time.perf_counter()
base = rss()
ds = PreparedDataset(sys.argv[1])
packed = PackedDocs(ds, 2048, seed=0, pad_id=0, packing="docs")
x, y = packed.global_batch(0, 8)
t2 = time.perf_counter()
for step in range(0, packed.sequences_per_epoch() // 8, 50):  # walk the epoch
    packed.global_batch(step, 8)
print(t2 - t1, t1 - t0, (rss() - base) / 2**20, len(ds))
"""


def rank_startup(path: str) -> tuple[float, float, float, int]:
    """(seconds to a first batch after imports, import seconds, MiB resident growth after
    walking an epoch (mapped pages read count: they are the page cache, shared by a node's ranks), docs)."""
    out = subprocess.run([sys.executable, "-c", RANK, path], capture_output=True, text=True, check=True)
    a, b, c, d = out.stdout.split()
    return float(a), float(b), float(c), int(d)


def prepare(data: str, ckpt: str, cache: str, workers: int) -> tuple[str, float]:
    from megaft.config.data import DataConfig
    from megaft.data.prepare import prepare_dataset

    cfg = DataConfig(path=data, chat_template="chatml", cache_dir=cache, prepare_workers=workers, seq_len=2048)
    start = time.perf_counter()
    ds = prepare_dataset(cfg, init_from=ckpt, progress=False)
    return ds.path, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the generated JSONL in MB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="megaft-bench-data-")
    ckpt = os.path.join(work, "ckpt")
    checkpoint(ckpt)
    big, small = os.path.join(work, f"chat-{args.mb}mb.jsonl"), os.path.join(work, "chat-1mb.jsonl")
    records = generate(big, args.mb)
    generate(small, 1, seed=1)
    direct = direct_tokenize(big, os.path.join(ckpt, "tokenizer.json"))
    path, seconds = prepare(big, ckpt, os.path.join(work, "cache"), args.workers)
    small_path, _ = prepare(small, ckpt, os.path.join(work, "cache"), args.workers)
    mb = os.path.getsize(big) / 2**20
    print(f"data: {mb:.0f} MB, {records} conversations; cache {path}")
    print(f"prepare ({args.workers} workers, template + masks + store): {mb / seconds:8.1f} MB/s")
    print(f"tokenizers directly (1 process, no template):        {mb / direct:8.1f} MB/s")
    print(f"ratio prepare / direct: {direct / seconds:.2f}")
    first, imports, rss, docs = rank_startup(path)
    _, _, rss_small, _ = rank_startup(small_path)
    print(f"rank start-up on the ready cache ({docs} docs): {first:.2f} s to the first batch "
          f"(+{imports:.2f} s of imports); target < 2 s")
    print(f"anonymous resident growth: {rss:.1f} MiB ({mb:.0f} MB data) vs {rss_small:.1f} MiB (1 MB data): "
          f"+{rss - rss_small:.1f} MiB; target < 50 MiB")


if __name__ == "__main__":
    main()
