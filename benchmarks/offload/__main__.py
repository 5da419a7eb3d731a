"""Optimizer step time with the state on the device vs offloaded to the host.

    python -m benchmarks.offload [--params 1 10 50] [--device auto|cpu|cuda] [--zero 0] [--repeats 7]

For each size (millions of fp32 params, a stack of square Linear layers) one process
builds the same model twice through megaft.optim.build_optimizer (dp=1): once with the
AdamW state on the device (`optim.fused=auto`) and once with `parallel.offload=cpu`
(pinned host masters and moments, the _C AdamW; megaft.optim.offload). After checking
that one step gives the same params (llm.c: validate before timing), it times the
median of `--repeats` steps (after one warmup), each including the D2H grad copies and
the H2D param copies. `ratio` = offloaded / on-device, the reference measured in the
same run. On a CPU device both update host memory, so the ratio shows the copies'
and the bookkeeping's cost; on a GPU it is the price of the freed device memory
(12 bytes/param at zero=0, /dp with ZeRO).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from megaft.config.optim import OptimConfig
from megaft.optim.zero import build_optimizer
from megaft.parallel.grid import ParallelGrid


def _model(millions: float, device: torch.device) -> nn.Module:
    width = 1024
    layers = max(1, round(millions * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def _build(millions: float, device: torch.device, zero: int, offload: str):
    model = _model(millions, device)
    flat, opt, _ = build_optimizer(model, OptimConfig(), zero=zero, bucket_mb=25.0,
                                   grid=ParallelGrid.single(device), offload=offload)
    torch.manual_seed(1)
    for g in opt.grads:
        g.copy_(torch.randn_like(g))
    return model, flat, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_step(opt, device: torch.device, repeats: int) -> float:
    opt.step(1e-4)  # warmup
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step(1e-4)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, nargs="+", default=[1.0, 10.0, 50.0], help="millions of params")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    print(f"optimizer step, device={name} zero={args.zero} dp=1, torch threads={torch.get_num_threads()}, "
          f"median of {args.repeats}")
    print(f"{'params_M':>8} {'on_device_ms':>12} {'offload_ms':>10} {'ratio':>6} {'device_opt_MiB':>14} "
          f"{'host_opt_MiB':>12}")
    for millions in args.params:
        _, flat_d, opt_d = _build(millions, device, args.zero, "none")
        _, flat_h, opt_h = _build(millions, device, args.zero, "cpu")
        opt_d.step(1e-4)
        opt_h.step(1e-4)
        for a, b in zip(flat_d.groups, flat_h.groups):  # the same update (fp32 rounding across kernels)
            torch.testing.assert_close(b.data, a.data, rtol=1e-6, atol=1e-7)
        on_dev, off = _time_step(opt_d, device, args.repeats), _time_step(opt_h, device, args.repeats)
        n = sum(g.data.numel() for g in flat_d.groups)
        mem_d, mem_h = opt_d.memory_bytes(), opt_h.memory_bytes()
        print(f"{n / 1e6:8.1f} {on_dev * 1e3:12.2f} {off * 1e3:10.2f} {off / on_dev:6.2f} "
              f"{mem_d['optimizer'] / 2 ** 20:14.1f} {mem_h['host']['optimizer'] / 2 ** 20:12.1f}")
        del flat_d, opt_d, flat_h, opt_h


if __name__ == "__main__":
    main()
