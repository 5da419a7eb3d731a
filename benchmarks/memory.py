"""Activation memory, recompute cost and the cp ring's traffic (issue 13), each against a
reference from the same run:

1. Bytes one decoder block saves for backward, measured with saved_tensors_hooks during a
   real forward (megaft.models.saved) on 1, 2 and 4 gloo ranks, against the estimate
   (megaft.perf.counts.activation_bytes_per_token) for recompute none/selective/full x
   tp 1/2 x sequence parallel on/off x cp 1/2; and cp=2 against cp=1.
2. The bytes each rank sends around the cp ring in one forward + backward, counted at the
   send (megaft.parallel.context.ring.bytes_sent), against the formula (megaft.perf.counts.ring_bytes).
3. Step time (forward + backward) of each recompute mode as a ratio against `none`, in
   alternating rounds (A B C, C B A, ...) on one process; on CUDA also the peak memory.
4. A preference micro-batch (train.objective=dpo): the bytes one block saves in the DPO
   forward (megaft.pref.logps.decoder_token_logps on megaft.pref.batches.PairRows' rows: a
   pair is two rows) against the memory check's own count (megaft.perf.memory.estimate_ranks).

    python -m benchmarks.memory                      # CPU: tiny blocks, ~1 minute
    python -m benchmarks.memory --device cuda --dim 4096 --heads 32 --kv-heads 8 --ffn 14336 \\
        --seq 8192 --layers 4 --rows 1 --precision bf16  # a GPU: Llama-3-8B-wide blocks, peak memory

Ranks 2 and 4 run on CPU with gloo (the ring's p2p and the tp collectives are real).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.ranks import on_gloo_ranks
from benchmarks.train_step.measure import round_orders
from megaft.config import Config
from megaft.config.model import ModelConfig
from megaft.models.attention.documents import Docs
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.models.saved import block_bytes, saved_bytes
from megaft.parallel.context import context_shard
from megaft.parallel.context.ring import bytes_sent
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import activation_bytes_per_token, ring_bytes
from megaft.perf.memory import estimate_ranks
from megaft.pref.batches import PairRows
from megaft.pref.data import Pair
from megaft.pref.logps import decoder_token_logps

MODES = ("none", "selective", "full")
ROWS, SEQ = 2, 32  # the measured rows (block_bytes compares 2*SEQ with SEQ tokens)
PAIRS = 2  # the pairs of the measured preference micro-batch
LAYOUTS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(2, 2)]}  # world size -> (tp, cp) measured there


def block_model(layers: int, recompute: str) -> ModelConfig:
    return ModelConfig(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50,
                       max_seq_len=4 * SEQ, recompute=recompute)


def _build(cfg: ModelConfig, grid: ParallelGrid, sp: bool) -> Decoder:
    model = Decoder(cfg, group=grid.tp_group, sequence_parallel=sp)
    init_params(model, cfg, seed=1, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    return model


def _batch(grid: ParallelGrid, seq: int, vocab: int):
    """(ids, labels, docs) of this rank: ROWS seeded rows of `seq` tokens, its cp chunks under cp."""
    ids = torch.randint(0, vocab, (ROWS, seq), generator=torch.Generator().manual_seed(0))
    if grid.cp_size > 1:
        ids, labels, positions, doc_ids, shard = context_shard(ids, ids, None, grid.cp_group)
        return ids, labels, Docs(positions, doc_ids, shard)
    return ids, ids, None


def rank_block_bytes(grid: ParallelGrid, recompute: str, sp: bool) -> float:
    """One block's saved bytes on this rank, for ROWS rows of SEQ tokens."""
    def measure(layers: int, seq: int) -> int:
        model = _build(block_model(layers, recompute), grid, sp)
        ids, labels, docs = _batch(grid, seq, model.cfg.vocab_size)
        return saved_bytes(model, lambda: model.loss_sum(ids, labels, docs))

    return block_bytes(measure, SEQ)


def estimated_block_bytes(tp: int, sp: bool, cp: int, mode: str) -> float:
    """The estimate of `rank_block_bytes`: per token times this rank's ROWS*SEQ/cp tokens."""
    m = block_model(2, mode)
    return activation_bytes_per_token(m, tp=tp, sequence_parallel=sp, precision="fp32", recompute=mode,
                                      cp=cp) * ROWS * SEQ // cp


def key(tp: int, sp: bool, cp: int, mode: str) -> str:
    return f"tp{tp}_sp{int(sp)}_cp{cp}_{mode}"


def parse_key(name: str) -> tuple[int, bool, int, str]:
    tp, sp, cp, mode = name.split("_")
    return int(tp[2:]), sp == "sp1", int(cp[2:]), mode


def ring_traffic(grid: ParallelGrid, mode: str) -> tuple[int, int]:
    """(measured, formula) bytes this rank sends around the ring in one forward + backward
    of a 2-block model on 2*SEQ-token rows."""
    model = _build(block_model(2, mode), grid, False)
    ids, labels, docs = _batch(grid, 2 * SEQ, model.cfg.vocab_size)
    before = bytes_sent()
    model.loss_sum(ids, labels, docs).backward()
    kv = model.layers[0].self_attn.n_kv
    formula = 2 * ring_bytes(ROWS, 2 * SEQ, kv, model.cfg.hd, grid.cp_size, itemsize=4,
                             recompute_forward=mode == "full")
    return bytes_sent() - before, formula


def measure_layouts(rank: int, world: int) -> dict[str, object]:
    """This rank's per-block bytes at every (tp, sp, cp, recompute) measured at this world
    size, and its ring traffic ("ring_" keys)."""
    out: dict[str, object] = {}
    for tp, cp in LAYOUTS[world]:
        grid = (ParallelGrid.single() if world == 1 else
                ParallelGrid.build(tp=tp, dp=world // (tp * cp), pp=1, cp=cp, device="cpu"))
        for sp in ((False, True) if tp > 1 else (False,)):
            for mode in MODES:
                out[key(tp, sp, cp, mode)] = rank_block_bytes(grid, mode, sp)
        if cp > 1:
            for mode in MODES:
                out["ring_" + key(tp, False, cp, mode)] = ring_traffic(grid, mode)
    return out


def measure_all() -> dict[str, object]:
    """Every layout's measurements (rank 0's): world 1 here, 2 and 4 on spawned gloo ranks."""
    out = measure_layouts(0, 1)
    for world in (2, 4):
        out.update(on_gloo_ranks(world, measure_layouts))
    return out


def pair_rows(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of PAIRS preference pairs whose rows all fill `seq` tokens (the memory
    check counts whole rows: data.seq_len each)."""
    half = seq // 2
    table = [Pair(list(range(3, 3 + half)), [4 + i] * (seq - half), [5 + i] * (seq - half)) for i in range(PAIRS)]
    return PairRows(table, seq, seed=0, pad_id=0).rows(torch.arange(PAIRS))


def pair_block_bytes() -> float:
    """One block's saved bytes in a DPO forward over PAIRS pairs of SEQ-token rows."""
    def measure(layers: int, seq: int) -> int:
        model = _build(block_model(layers, "none"), ParallelGrid.single(), False)
        inputs, labels = pair_rows(seq)
        return saved_bytes(model, lambda: decoder_token_logps(model, inputs, labels).sum())

    return block_bytes(measure, SEQ)


def estimated_pair_block_bytes(objective: str = "dpo") -> float:
    """The memory check's activations of one block for a micro-batch of PAIRS pairs at
    data.seq_len=SEQ: its 4-block estimate less its 2-block one, halved (the head cancels)."""
    def activations(layers: int) -> int:
        cfg = Config()
        cfg.model, cfg.data.seq_len, cfg.train.objective = block_model(layers, "none"), SEQ, objective
        cfg.train.micro_batch_size = cfg.train.global_batch_size = PAIRS
        return estimate_ranks(cfg, 1)[0].activations

    return (activations(4) - activations(2)) / 2


def step_times(args) -> dict[str, tuple[float, int]]:
    """{mode: (median seconds of forward + backward, peak bytes on CUDA or 0)} in alternating rounds."""
    device = torch.device(args.device)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.precision]
    models = {}
    for mode in MODES:
        cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                          ffn_dim=args.ffn, vocab_size=args.vocab, max_seq_len=args.seq, recompute=mode)
        model = Decoder(cfg)
        init_params(model, cfg, seed=1, tp_rank=0, tp_size=1)
        models[mode] = model.to(device)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    peaks = dict.fromkeys(MODES, 0)

    def one(mode: str) -> float:
        model = models[mode]
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model.loss_sum(ids, ids)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated())
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for mode in MODES:  # warm-up
        one(mode)
    for order in round_orders(list(MODES), args.rounds):
        for mode in order:
            times[mode].append(one(mode))
    return {m: (statistics.median(times[m]), peaks[m]) for m in MODES}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--skip-ranks", action="store_true", help="only the step times (no gloo ranks)")
    args = p.parse_args(argv)

    if not args.skip_ranks:
        measured = measure_all()
        print(f"bytes one block saves for backward ({ROWS} rows x {SEQ} tokens, fp32; per rank)")
        print(f"{'layout':>14} {'recompute':>10} {'estimated':>10} {'measured':>10} {'meas/est':>9} {'vs cp=1':>8}")
        for name in sorted(k for k in measured if not k.startswith("ring_")):
            tp, sp, cp, mode = parse_key(name)
            est, got = estimated_block_bytes(tp, sp, cp, mode), measured[name]
            halved = f"{got / measured[key(tp, sp, 1, mode)]:.3f}" if cp > 1 else ""
            print(f"{f'tp{tp} sp{int(sp)} cp{cp}':>14} {mode:>10} {est:>10.0f} {got:>10.0f} {got / est:>9.3f} "
                  f"{halved:>8}")
        print("\ncp ring traffic per rank, one forward + backward of 2 blocks "
              f"({ROWS} rows x {2 * SEQ} tokens, fp32)")
        for name in sorted(k for k in measured if k.startswith("ring_")):
            got, formula = measured[name]
            print(f"{name[5:]:>22}: sent {got} B, formula {formula} B, ratio {got / formula:.3f}")
    est, got = estimated_pair_block_bytes(), pair_block_bytes()
    print(f"\nbytes one block saves in a DPO forward ({PAIRS} pairs = {2 * PAIRS} rows x {SEQ} tokens, fp32): "
          f"estimated {est:.0f}, measured {got:.0f}, meas/est {got / est:.3f}")
    res = step_times(args)
    base = res["none"][0]
    print(f"\nforward + backward, {args.rows} x {args.seq} tokens, dim {args.dim}, {args.layers} layers, "
          f"{args.precision} on {args.device} ({args.rounds} alternating rounds, median)")
    for mode in MODES:
        t, peak = res[mode]
        mem = f"peak {peak / 2 ** 20:.1f} MiB" if peak else "peak memory: not measured (no GPU)"
        print(f"  {mode:>9}: {t * 1e3:8.1f} ms  x{t / base:.3f} of none   {mem}")


if __name__ == "__main__":
    main()
