"""The timed rank function of the dp_overlap benchmark (importable: spawned ranks load it)."""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from megaft.config.model import ModelConfig
from megaft.models.decoder import Decoder
from megaft.parallel.data.buckets import GradReducer
from megaft.parallel.data.flat import FlatParams


def model_of(args) -> Decoder:
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=8, ffn_dim=args.dim * 3, vocab_size=1024,
                      max_seq_len=args.seq)
    torch.manual_seed(0)
    return Decoder(cfg)


def _times(fns: list, repeats: int) -> list[float]:
    """Median seconds of each fn; the fns take turns within every repeat, so load drift on a
    shared machine hits them alike. A barrier starts every timing on all ranks together."""
    for fn in fns:
        fn()  # warmup
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, out):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in out]


def _measure(args, ids, mb: float, compression: str) -> tuple:
    """One table row: bucket size, compression, buckets, the four times, MiB sent per reduction."""
    model = model_of(args)
    flat = FlatParams(model, weight_decay=0.0, device=torch.device("cpu"), bucket_numel=int(mb * 2 ** 20) // 4)
    options = dict(compression=compression, powersgd_rank=args.powersgd_rank)
    seq = GradReducer(flat, dist.group.WORLD, overlap=False, **options)

    def backward():
        model.loss_sum(ids, ids).backward()

    def reduce():
        seq.finish()

    def sequential():
        backward()
        seq.finish()

    over = GradReducer(flat, dist.group.WORLD, **options)

    def overlapped():
        over.arm()
        backward()
        over.finish()

    t_bwd, t_red, t_seq, t_over = _times([backward, reduce, sequential, overlapped], args.repeats)
    over.remove_hooks()
    seq.take_sent_bytes()
    seq.finish()
    sent = seq.take_sent_bytes() / 2 ** 20
    return mb, compression, len(flat.buckets), t_bwd, t_red, t_seq, t_over, sent


def run_rank(rank: int, world: int, args) -> list[tuple]:
    """One row per bucket size and compression (benchmarks.ranks.on_gloo_ranks keeps rank 0's)."""
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    rows = []
    for mb in args.bucket_mb:
        for compression in args.compression:
            rows.append(_measure(args, ids, mb, compression))
            gc.collect()  # the reducers' last async works go before the next model's (and the group's end)
    return rows
