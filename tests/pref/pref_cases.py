"""megaft's side of the preference tests (tests/pref/test_losses.py), in a module without
TRL's imports: the spawned tp ranks import only this."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaft.config.kernels import KernelsConfig
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads
from megaft.parallel.tensor.shard import local_from_full
from megaft.pref.logps import SequenceLogps, decoder_token_logps, next_token_labels, sequence_logps
from megaft.pref.losses import preference_loss

# fp32 on both sides; TRL's fused LM head (tiled log-softmax over the completion tokens),
# megaft's vocab-parallel cross-entropy and its tp partial sums add in other orders:
# ~1e-6 on log-probs of ~-25.
ATOL = RTOL = 1e-5


def megaft_model(path: str, kernels=None, *, group=None, tp_rank: int = 0, tp_size: int = 1,
                 sequence_parallel: bool = False) -> Decoder:
    """The HF checkpoint `path` as a megaft Decoder (this rank's shard under tp)."""
    model = Decoder(hf_model_config(path), kernels=kernels, group=group, sequence_parallel=sequence_parallel)
    load_hf_weights(model, path, tp_rank=tp_rank, tp_size=tp_size)
    return model


def sequence_of(model: Decoder, ids: torch.Tensor, mask: torch.Tensor) -> SequenceLogps:
    """Log-probs of the tokens `mask` marks (TRL's completion mask) in each row of `ids`."""
    labels = next_token_labels(ids, mask)
    return sequence_logps(decoder_token_logps(model, ids, labels), labels)


def _dpo_on(policy: Decoder, ref: Decoder, ids: torch.Tensor, mask: torch.Tensor):
    """The DPO loss of a [chosen; rejected] batch, backward run, and the policy's log-probs."""
    pairs = ids.shape[0] // 2
    logps = sequence_of(policy, ids, mask)
    with torch.no_grad():
        reference = sequence_of(ref, ids, mask)
    losses, _ = preference_loss("dpo", *logps.split(pairs), *reference.split(pairs), beta=0.5)
    losses.mean().backward()
    return losses.detach(), logps.sum.detach()


def tp2_rank(rank: int, world: int, policy: str, ref: str) -> None:
    """tp=2 (plain, then sequence parallel with the fused head) against the single process."""
    # 61 tokens: tp=2 pads the vocabulary to 62, so the padded column is exercised too
    ids = torch.randint(3, 61, (4, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros_like(ids)
    for row, (start, end) in enumerate(((3, 13), (5, 9), (3, 6), (5, 12))):
        mask[row, start:end] = 1
    single = megaft_model(policy)
    want_losses, want_logps = _dpo_on(single, megaft_model(ref), ids, mask)
    want = {n: p.grad for n, p in single.named_parameters()}
    fused = KernelsConfig(backend="torch", fused_linear_cross_entropy=True, ce_chunk_tokens=5)
    failures = []
    for sp, kernels in ((False, None), (True, fused)):
        shard = dict(group=dist.group.WORLD, tp_rank=rank, tp_size=world, sequence_parallel=sp)
        model = megaft_model(policy, kernels, **shard)
        losses, logps = _dpo_on(model, megaft_model(ref, kernels, **shard), ids, mask)
        sync_sequence_parallel_grads(list(model.parameters()), dist.group.WORLD)
        got = {"losses": (losses, want_losses), "logps": (logps, want_logps)}
        got.update({n: (p.grad, local_from_full(want[n], p, rank, world)) for n, p in model.named_parameters()})
        for name, (a, b) in got.items():
            try:
                torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
            except AssertionError as e:
                failures.append(f"sp={sp} fused={kernels is not None} {name}: {e}")
    assert not failures, "\n".join(failures)
