"""Checks shared by the in-process and spawned architecture tests (test_arch.py).

Each returns a list of failures (so one spawn reports every family at once) and
compares megaft with transformers on one random checkpoint per family: logits, the
token-weighted loss, the exported folder (same model_type, bit-exact tensors, equal
logits after a transformers reload) and, for tp wider than the kv heads, every grad.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaft.inference.generate import full_logits
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.export import export_hf
from megaft.models.hf.load import load_hf_weights
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads
from megaft.parallel.tensor.shard import local_from_full, shard_of
from megaft.pipeline.stage import StageModel
from models.arch_fixture import SEQ, VOCAB, load_reference, sample_ids
from models.hf_fixture import checkpoint_tensors, padded_lines

# fp32 on both sides; what differs is summation order (SDPA vs eager attention, tp
# partial sums, kv-grad sums over replicas): ~1e-6 on logits and grads of magnitude ~1.
ATOL = RTOL = 1e-5


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded lines of unequal length (the longest longer than every window);
    labels are next tokens, -100 on padding."""
    return padded_lines([SEQ, 5, 11], seed=seed, low=3)


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / (
        (labels != -100).sum())


def _close(failures: list[str], tag: str, actual, expected, atol=ATOL, rtol=RTOL) -> None:
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    except AssertionError as e:
        failures.append(f"{tag}: {e}")


def check_export(src: str, out: str, tag: str) -> list[str]:
    """The exported folder: same model_type/architectures, every tensor bit-exact,
    and transformers' reload gives the source checkpoint's logits exactly."""
    failures = []
    with open(os.path.join(src, "config.json")) as f:
        want = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        got = json.load(f)
    for key in ("model_type", "architectures"):
        if got[key] != want[key]:
            failures.append(f"{tag} export {key}: {got[key]} != {want[key]}")
    exported, original = checkpoint_tensors(out), checkpoint_tensors(src)
    if exported.keys() != original.keys():
        failures.append(f"{tag} export names: {sorted(exported.keys() ^ original.keys())}")
    failures += [f"{tag} export tensor {n} differs" for n, t in original.items()
                 if n in exported and not torch.equal(exported[n], t)]
    reloaded, reference = load_reference(out), load_reference(src)
    if reloaded.config.model_type != want["model_type"]:
        failures.append(f"{tag} reload model_type {reloaded.config.model_type}")
    ids = sample_ids(3)
    with torch.no_grad():
        _close(failures, f"{tag} reload logits", reloaded(ids).logits, reference(ids).logits, atol=0, rtol=0)
    return failures


def check_tp(path: str, out: str, *, tag: str, tp_rank: int, tp_size: int, group) -> list[str]:
    """Logits and loss at this tp degree vs transformers; export and reload."""
    failures = []
    cfg = hf_model_config(path)
    model = Decoder(cfg, group=group)
    load_hf_weights(model, path, tp_rank=tp_rank, tp_size=tp_size)
    reference = load_reference(path)
    ids, (lines, labels) = sample_ids(), batch()
    with torch.no_grad():
        _close(failures, f"{tag} logits", full_logits(model, ids), reference(ids).logits)
        loss = model.loss_sum(lines, labels) / (labels != -100).sum()
        _close(failures, f"{tag} loss", loss, reference_loss(reference(lines).logits, labels))
    export_hf(model, cfg, out, tokenizer_json=path, tp_group=group, is_writer=tp_rank == 0)
    return failures + (check_export(path, out, tag) if tp_rank == 0 else [])


def check_pp2(path: str, out: str, *, tag: str, pp_rank: int) -> list[str]:
    """Two pipeline stages (one block each) on ranks 0 and 1: the last stage's logits
    and loss vs transformers; the stages' joint export reloads in transformers."""
    failures = []
    cfg = hf_model_config(path)
    model = StageModel(cfg, pp=2, pp_rank=pp_rank)
    load_hf_weights(model, path, tp_rank=0, tp_size=1, strict=False)  # each stage reads its own tensors
    ids, (lines, labels) = sample_ids(), batch()
    with torch.no_grad():
        if pp_rank == 0:
            for x in (ids, lines):
                dist.send(model(0, x).contiguous(), 1)
        else:
            reference = load_reference(path)
            hidden = [torch.empty(model.activation_shape(*x.shape)) for x in (ids, lines)]
            for h in hidden:
                dist.recv(h, 0)
            _close(failures, f"{tag} logits", model(1, hidden[0])[..., :VOCAB], reference(ids).logits)
            loss = model(1, hidden[1], labels) / (labels != -100).sum()
            _close(failures, f"{tag} loss", loss, reference_loss(reference(lines).logits, labels))
    export_hf(model, cfg, out, tokenizer_json=path, tp_group=None, is_writer=True, pp_group=dist.group.WORLD)
    return failures + (check_export(path, out, tag) if pp_rank == 0 else [])


def _grads(model, lines, labels) -> dict[str, torch.Tensor]:
    (model.loss_sum(lines, labels) / (labels != -100).sum()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def check_wide_tp(path: str, out: str, *, tag: str, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False) -> list[str]:
    """tp wider than the kv heads equals tp=1: logits, every grad (replicated kv heads
    summed over their copies, which stay bit-identical), and the export writes each head once."""
    failures = []
    cfg = hf_model_config(path)
    ref = Decoder(cfg)
    load_hf_weights(ref, path, tp_rank=0, tp_size=1)
    model = Decoder(cfg, group=group, sequence_parallel=sequence_parallel)
    load_hf_weights(model, path, tp_rank=tp_rank, tp_size=tp_size)
    ids, (lines, labels) = sample_ids(), batch()
    with torch.no_grad():
        _close(failures, f"{tag} logits", full_logits(model, ids), full_logits(ref, ids))
    want, _ = _grads(ref, lines, labels), _grads(model, lines, labels)
    sync_sequence_parallel_grads(list(model.parameters()), group)
    for name, p in model.named_parameters():
        _close(failures, f"{tag} grad {name}", p.grad, local_from_full(want[name], p, tp_rank, tp_size))
        replicas = getattr(shard_of(p), "replicas", 1)
        if replicas > 1:  # copies of one kv head: identical bits, or they drift apart in training
            every = [torch.empty_like(p.grad) for _ in range(tp_size)]
            dist.all_gather(every, p.grad.contiguous(), group=group)
            first = tp_rank // replicas * replicas
            if not torch.equal(every[first], p.grad):
                failures.append(f"{tag} grad {name}: copies of a kv head differ")
    export_hf(model, cfg, out, tokenizer_json=path, tp_group=group, is_writer=tp_rank == 0)
    return failures + (check_export(path, out, tag) if tp_rank == 0 else [])


def raise_failures(failures: list[str], where: str) -> None:
    if dist.is_initialized():  # every rank done before any tears its process group down
        dist.barrier()
    if failures:
        raise AssertionError(f"{where}: {len(failures)} failures:\n" + "\n".join(failures))


def tp_rank_fn(rank: int, world: int, dirs: dict[str, str], out_root: str) -> None:
    failures = []
    for name, path in dirs.items():
        failures += check_tp(path, os.path.join(out_root, f"tp{world}", name), tag=f"{name} tp={world}",
                             tp_rank=rank, tp_size=world, group=dist.group.WORLD)
    raise_failures(failures, f"rank {rank}")


def pp2_rank_fn(rank: int, world: int, dirs: dict[str, str], out_root: str) -> None:
    failures = []
    for name, path in dirs.items():
        failures += check_pp2(path, os.path.join(out_root, "pp2", name), tag=f"{name} pp=2", pp_rank=rank)
    raise_failures(failures, f"rank {rank}")


def wide_tp_rank_fn(rank: int, world: int, dirs: dict[str, str], out_root: str) -> None:
    failures = []
    for name, path in dirs.items():
        failures += check_wide_tp(path, os.path.join(out_root, f"tp{world}", name), tag=f"{name} tp={world}",
                                  tp_rank=rank, tp_size=world, group=dist.group.WORLD)
    # sequence parallel on top: qk-norm weights shared over tp, kv copies, sequence shards
    failures += check_wide_tp(dirs["qwen3"], os.path.join(out_root, f"tp{world}_sp", "qwen3"),
                              tag=f"qwen3 tp={world} sp", tp_rank=rank, tp_size=world, group=dist.group.WORLD,
                              sequence_parallel=True)
    raise_failures(failures, f"rank {rank}")
