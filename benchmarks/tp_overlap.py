"""parallel.tp_overlap=ring against the plain sequence-parallel path: one decoder block's forward +
backward on tp ranks, timed both ways after checking that they agree.

    GPU (one node, NCCL, bf16 autocast; Llama-3.1-70B's block at tp 4, one 4096-token row):
      torchrun --nproc-per-node 4 -m benchmarks.tp_overlap --dim 8192 --heads 64 --kv-heads 8 --ffn 28672 \\
          --seq 4096 --precision bf16
    CPU (gloo ranks spawned here, fp32; the values, and a rough time on a shared box):
      python -m benchmarks.tp_overlap --tp 2

Each rank builds the same seeded block (megaft.models.decoder.Block with sequence parallel; with
and without the ring, megaft.parallel.tensor.overlap), runs its sequence shard of a [batch, seq, dim]
input, and first compares the ring's output and parameter grads with the plain path's (fp32:
reassociation only; bf16: the compute dtype's rounding). Then both alternate for --repeats timed
repeats (median, a barrier and a device synchronize around each); rank 0 prints the two medians and
their ratio, the number the cost model predicts as the hidden share of the block's tp_comm
(megaft.perf.time._ring_tp_s; docs/plan-and-scale.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _block(args, ring: bool, device: torch.device):
    from megaft.config.model import ModelConfig
    from megaft.models.decoder import Block, register_rope, rope_of
    from megaft.models.init import init_params

    cfg = ModelConfig(dim=args.dim, n_layers=1, n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn,
                      vocab_size=128, max_seq_len=args.seq)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([Block(cfg, group=dist.group.WORLD, sequence_parallel=True,
                                               tp_overlap=ring)])
    register_rope(holder, cfg)
    init_params(holder, cfg, seed=0, tp_rank=dist.get_rank(), tp_size=dist.get_world_size())
    holder.to(device)
    return holder.layers[0], rope_of(holder, cfg, 0)


def run_rank(rank: int, world: int, args) -> tuple[float, float, float]:
    """(plain seconds, ring seconds, largest relative difference of output and grads)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    (plain, rope), (ring, _) = _block(args, False, device), _block(args, True, device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.seq // world, args.dim, generator=g).to(device).requires_grad_()
    dy = torch.randn(x.shape, generator=g).to(device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def step(block):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = block(x, *rope)
        y.backward(dy)
        return y.detach()

    outs = []
    for block in (plain, ring):
        block.zero_grad(set_to_none=True)
        outs.append([step(block)] + [p.grad for p in block.parameters()])
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*outs))
    times: list[list[float]] = [[], []]
    for _ in range(args.repeats + 1):  # the first round warms up
        for t, block in zip(times, (plain, ring)):
            block.zero_grad(set_to_none=True)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(block)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
    return statistics.median(times[0][1:]), statistics.median(times[1][1:]), err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="ranks to spawn on CPU (under torchrun: its world size)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun: NCCL on GPUs (gloo without them)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        result = run_rank(rank, world, args)
        dist.destroy_process_group()
        if rank:
            return
    else:
        from benchmarks.ranks import on_gloo_ranks

        world, result = args.tp, on_gloo_ranks(args.tp, run_rank, args)
    plain, ring, err = result
    print(f"tp={world} block dim={args.dim} heads={args.heads}/{args.kv_heads} ffn={args.ffn} "
          f"tokens={args.batch}x{args.seq} {args.precision}, median of {args.repeats}")
    print(f"max relative difference ring vs plain (output, grads): {err:.1e}")
    print(f"plain {plain * 1e3:.2f} ms  ring {ring * 1e3:.2f} ms  ring/plain {ring / plain:.3f}")


if __name__ == "__main__":
    main()
