"""The two-rank checks of DeepSeek-V3 (test_deepseek_v3.py), all in one spawned group: tp=2 with
and without sequence parallel, ep=2 and cp=2 against the single process on the same checkpoint
(logits, loss, every gradient), and the tp=2 export. Each check returns its failures, so one
spawn reports them all."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megaft.inference.generate import full_logits
from megaft.models.attention.documents import Docs
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.export import export_hf
from megaft.models.hf.load import load_hf_weights
from megaft.parallel.context.batch import context_shard
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads
from megaft.parallel.tensor.shard import expert_slice_of, local_from_full
from models.deepseek_fixture import labels_of, sample_ids
from models.hf_fixture import checkpoint_tensors

# fp32 on both sides; sums differ in order only (tp partial sums, the ring's merged blocks): ~1e-6
TOL = 1e-5


def _close(failures: list[str], tag: str, actual, expected) -> None:
    try:
        torch.testing.assert_close(actual, expected, atol=TOL, rtol=TOL)
    except AssertionError as e:
        failures.append(f"{tag}: {e}")


def _model(path: str, **kwargs) -> Decoder:
    model = Decoder(hf_model_config(path), **kwargs)
    rank, size = (dist.get_rank(), 2) if "group" in kwargs else (0, 1)
    load_hf_weights(model, path, tp_rank=rank, tp_size=size)
    return model


def _backward(model: Decoder, ids, labels, docs=None, tokens=None) -> torch.Tensor:
    """The micro-batch loss (CE over `tokens` targets plus the router terms), back-propagated."""
    loss = model.loss_sum(ids, labels, docs) / (tokens or (labels != -100).sum())
    loss = loss + model.router_losses().local
    loss.backward()
    return loss.detach()


def check_tp(path: str, out: str, tag: str, sequence_parallel: bool) -> list[str]:
    failures, rank = [], dist.get_rank()
    ref, model = _model(path), _model(path, group=dist.group.WORLD, sequence_parallel=sequence_parallel)
    ids = sample_ids(1)
    with torch.no_grad():
        _close(failures, f"{tag} logits", full_logits(model, ids), full_logits(ref, ids))
    labels = labels_of(ids)
    _close(failures, f"{tag} loss", _backward(model, ids, labels), _backward(ref, ids, labels))
    sync_sequence_parallel_grads(list(model.parameters()), dist.group.WORLD)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(failures, f"{tag} grad {name}", p.grad, local_from_full(want[name].grad, p, rank, 2))
    export_hf(model, model.cfg, out, tokenizer_json=path, tp_group=dist.group.WORLD, is_writer=rank == 0)
    if rank == 0:
        written, source = checkpoint_tensors(out), checkpoint_tensors(path)
        source = {k: v for k, v in source.items() if not k.startswith(f"model.layers.{model.cfg.n_layers}.")}
        if sorted(written) != sorted(source) or any(not torch.equal(written[k], source[k]) for k in source):
            failures.append(f"{tag} export differs from the source checkpoint")
    return failures


def check_ep(path: str) -> list[str]:
    """ep=2 over two data-parallel ranks, each with its own micro-batch: the experts' gradients
    are the single process's over both batches, the rest summed over the ranks (dp's reduction)."""
    failures, rank = [], dist.get_rank()
    ref = _model(path)
    model = Decoder(hf_model_config(path), ep_group=dist.group.WORLD)
    load_hf_weights(model, path, tp_rank=0, tp_size=1)
    batches = [sample_ids(2), sample_ids(3)]
    tokens = sum((labels_of(b) != -100).sum() for b in batches)
    for b in batches:  # the single process: both micro-batches' shares of the batch loss
        _backward(ref, b, labels_of(b), tokens=tokens)
    _backward(model, batches[rank], labels_of(batches[rank]), tokens=tokens)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if expert_slice_of(p) is None:  # replicated over the two ranks: dp sums their parts
            dist.all_reduce(grad)
        _close(failures, f"ep=2 grad {name}", grad, local_from_full(want[name].grad, p, 0, 1))
    return failures


def check_cp(path: str) -> list[str]:
    """cp=2: each rank holds two zig-zag chunks of every row; the ring attends over the row (the
    values zero-padded to the query width, megaft.models.attention.mla)."""
    failures = []
    ref, model = _model(path), _model(path)
    ids = sample_ids(4)[:, :16]  # 2 * cp equal chunks
    labels = labels_of(ids)
    tokens = (labels != -100).sum()
    want_loss = _backward(ref, ids, labels)
    mine, my_labels, positions, doc_ids, shard = context_shard(ids, labels, None, dist.group.WORLD)
    loss = model.loss_sum(mine, my_labels, Docs(positions, doc_ids, shard)) / tokens
    loss = loss + model.router_losses().local  # zero (no aux loss), collective over cp
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    _close(failures, "cp=2 loss", total, want_loss)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        _close(failures, f"cp=2 grad {name}", grad, want[name].grad)
    return failures


def two_rank_fn(rank: int, world: int, dirs: dict[str, str], out_root: str) -> None:
    failures = check_tp(dirs["latent_q"], os.path.join(out_root, "tp2_sp"), "latent_q tp=2 sp", True)
    failures += check_tp(dirs["plain_q"], os.path.join(out_root, "tp2"), "plain_q tp=2", False)
    failures += check_ep(dirs["latent_q"]) + check_cp(dirs["plain_q"])
    dist.barrier()
    if failures:
        raise AssertionError(f"rank {rank}: {len(failures)} failures:\n" + "\n".join(failures[:20]))


def bias_config(ckpt: str, data: str, **parallel):
    """3 steps of DeepSeek-V3 training with the correction biases moving (moe.bias_update_rate),
    exported, so the final biases can be read back."""
    from megaft.config import Config
    from megaft.validation import resolve

    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len, cfg.device = ckpt, data, 16, "cpu"
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size, t.progress, t.export_hf = 3, 2, 8, False, True
    t.eval_every, t.tensorboard, t.log_phases = 1000, "false", False
    cfg.moe.bias_update_rate = 0.05  # large: a few steps move the biases past the scores' gaps
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return resolve(cfg)


BIAS_LAYOUTS = {"dp2": dict(dp=2), "pp2": dict(pp=2)}


def bias_update_rank(rank: int, world: int, ckpt: str, data: str, root: str) -> None:
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer

    for name, par in BIAS_LAYOUTS.items():
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        grid = ParallelGrid.build(tp=1, dp=par.get("dp", 1), pp=par.get("pp", 1), device="cpu")
        Trainer(bias_config(ckpt, data, **par), grid, run_dir).fit()
