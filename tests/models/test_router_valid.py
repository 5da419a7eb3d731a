"""A micro-batch's token mask reaches a mixture of experts' router statistics as an argument of
the forward (`router_valid=`: Decoder.forward / blocks, StageModel.forward), never as state
set on the model: the load-balancing loss over the valid tokens equals transformers'
load_balancing_loss_func with that attention_mask, and the next forward without a mask counts
every token again."""
from __future__ import annotations

import pytest
import torch

from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.pipeline.stage import StageModel
from models.moe_fixture import SEQ, load_reference, make_hf_moe, sample_ids


def _loaded(cls, path: str, **kwargs):
    model = cls(hf_model_config(path), **kwargs)
    load_hf_weights(model, path, tp_rank=0, tp_size=1)
    return model


def _right_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ids and their mask: the first whole, the second 9 tokens then padding."""
    ids = sample_ids()
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 9:] = False
    return ids, valid


def test_decoder_counts_the_masked_tokens_as_transformers_attention_mask(tmp_path):
    make_hf_moe(str(tmp_path), "mixtral", sliding_window=None)
    ref, model = load_reference(str(tmp_path)), _loaded(Decoder, str(tmp_path))
    ids, valid = _right_padded()
    moe_layers = sum(model.cfg.is_moe(i) for i in range(model.cfg.n_layers))
    with torch.no_grad():
        want = ref(ids, attention_mask=valid.long(), output_router_logits=True).aux_loss
        model(ids, router_valid=valid)
        router = model.router_losses()
    assert router.aux.item() == pytest.approx(want.item(), rel=1e-6)
    assert router.counts.sum().item() == valid.sum().item() * model.cfg.top_k * moe_layers
    assert not hasattr(model, "router_valid")  # nothing is kept on the model
    # the next forward, without a mask, counts every token (and differs: the padding's routing is in)
    with torch.no_grad():
        model(ids)
        whole = model.router_losses()
        every = ref(ids, output_router_logits=True).aux_loss
    assert whole.counts.sum().item() == ids.numel() * model.cfg.top_k * moe_layers
    assert whole.aux.item() == pytest.approx(every.item(), rel=1e-6)
    assert whole.aux.item() != pytest.approx(router.aux.item(), rel=1e-6)
    # blocks (the fused linear cross-entropy's path) takes the same argument
    with torch.no_grad():
        model.blocks(ids, router_valid=valid)
    assert model.router_losses().aux.item() == router.aux.item()


def test_pipeline_stage_counts_the_masked_tokens(tmp_path):
    """StageModel.forward (what PipelineRuntime calls per micro-batch) takes the mask too."""
    make_hf_moe(str(tmp_path), "mixtral", sliding_window=None)
    whole, stage = _loaded(Decoder, str(tmp_path)), _loaded(StageModel, str(tmp_path), pp=1, pp_rank=0)
    ids, valid = _right_padded()
    with torch.no_grad():
        whole(ids, router_valid=valid)
        want = whole.router_sums()
        stage(0, ids, None, None, seq_len=SEQ, router_valid=valid)
        got = stage.router_sums()
        stage(0, ids, None, None, seq_len=SEQ)
        every = stage.router_sums()
    assert torch.equal(got.counts, want.counts) and got.tokens.item() == valid.sum().item()
    assert torch.allclose(got.whole_probs, want.whole_probs, rtol=1e-6, atol=0)
    assert every.tokens.item() == ids.numel()
