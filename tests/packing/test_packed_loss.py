"""data.packing=docs in the model: the loss (and every gradient) of a packed batch equals
the sum over its documents run through the model alone, at tp=1 (here), and at tp=2 with
sequence parallel and pp=2 (2 spawned gloo ranks, one spawn for both)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from multirank import spawn

from megaft.models.attention.documents import Docs, document_mask, mask_mod
from packing import doc_cases as C

# fp32: only the summation order differs (one row vs several, masked softmax): ~1e-7.
ATOL, RTOL = 1e-6, 1e-6


GEMMA2 = dict(arch="gemma2", sandwich_norms=True, attn_softcap=1.0, final_softcap=2.0, norm_offset=1.0,
              scale_embeddings=True, activation="gelu_pytorch_tanh", query_pre_attn_scalar=12.0, sliding_window=4)


@pytest.mark.parametrize("variant", ["llama", "window", "qwen3", "gemma2"])
def test_packed_loss_equals_each_document_alone(variant):
    kw = {"window": dict(arch="mistral", sliding_window=4), "qwen3": dict(arch="qwen3", qk_norm=True, head_dim=16),
          "gemma2": GEMMA2, "llama": {}}[variant]  # gemma2: the soft-capped explicit form with document masks
    cfg = C.model_config(**kw)
    model = C.full_model(cfg)
    ids, labels, docs, pieces = C.packed()
    want, want_grads = C.reference(model, pieces)
    model.zero_grad()
    got = model.loss_sum(ids, labels, docs)
    got.backward()
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    for n, p in model.named_parameters():  # atol scaled to the gradient (Gemma's scaled embeddings: ~17)
        scale = max(1.0, want_grads[n].abs().max().item())
        torch.testing.assert_close(p.grad, want_grads[n], atol=ATOL * scale, rtol=RTOL, msg=n)
    # without the document layout the same rows mix documents: the check can fail
    assert abs(model.loss_sum(ids, labels).double() - want) > 1e-3


def test_padding_positions_and_the_two_mask_forms_agree():
    ids, labels, docs, _ = C.packed()
    assert (docs.position_ids[docs.doc_ids == docs.doc_ids[:, :1]] >= 0).all()
    starts = torch.cat([torch.ones(docs.doc_ids.shape[0], 1, dtype=torch.bool),
                        docs.doc_ids[:, 1:] != docs.doc_ids[:, :-1]], dim=1)
    assert (docs.position_ids[starts] == 0).all()  # RoPE restarts in every document
    padded = docs.padded(C.SEQ + 3)
    assert padded.doc_ids.shape[1] == C.SEQ + 3 and (padded.doc_ids[:, -3:] > docs.doc_ids.max(1).values[:, None]).all()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(ids.shape[0], 2, C.SEQ, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for window in (None, 3):
        block = create_block_mask(mask_mod(docs, window), ids.shape[0], None, C.SEQ, C.SEQ, device="cpu")
        flex = flex_attention(q, k, v, block_mask=block)  # forward only on CPU (no flex backward there)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs, window))
        torch.testing.assert_close(flex, sdpa, atol=1e-6, rtol=1e-6)


def test_packed_loss_under_tp2_sp_and_pp2():
    spawn(2, _parallel_cases)


def _parallel_cases(rank: int, world: int) -> None:
    from megaft.models.decoder import Decoder
    from megaft.models.init import init_params
    from megaft.parallel.comm import all_reduce
    from megaft.parallel.grid import ParallelGrid
    from megaft.pipeline.runtime import PipelineRuntime
    from megaft.pipeline.stage import StageModel

    cfg = C.model_config()
    ids, labels, docs, pieces = C.packed()
    want, _ = C.reference(C.full_model(cfg), pieces)
    failures = []
    # tp=2 with sequence parallel: SEQ is padded to a multiple of tp inside the model
    grid = ParallelGrid.build(tp=2, dp=1, pp=1, device="cpu")
    model = Decoder(cfg, group=grid.tp_group, sequence_parallel=True)
    init_params(model, cfg, seed=5, tp_rank=grid.tp_rank, tp_size=2)
    odd = Docs(docs.position_ids[:, :-1], docs.doc_ids[:, :-1])  # an odd length: the sp padding path
    got = model.loss_sum(ids, labels, docs)
    got_odd = model.loss_sum(ids[:, :-1], labels[:, :-1], odd)
    want_odd = C.full_model(cfg).loss_sum(ids[:, :-1], labels[:, :-1], odd)
    for tag, g, w in (("tp2 sp", got, want), ("tp2 sp odd", got_odd, want_odd)):
        if abs(g.double().item() - w.double().item()) > ATOL * max(1.0, abs(w.item())):
            failures.append(f"{tag}: {g.item()} != {w.item()}")
    # pp=2: one micro-batch through the 1f1b runtime
    grid = ParallelGrid.build(tp=1, dp=1, pp=2, device="cpu")
    stages = StageModel(cfg, pp=2, pp_rank=grid.pp_rank, group=grid.tp_group)
    init_params(stages, cfg, seed=5, tp_rank=0, tp_size=1)
    runtime = PipelineRuntime(stages, grid, "1f1b", 1)
    loss = runtime.train_step([ids], [labels], 1, contextlib.nullcontext, [docs])
    all_reduce(loss, grid.pp_group)
    if abs(loss.item() - want.item()) > ATOL * max(1.0, abs(want.item())):
        failures.append(f"pp2: {loss.item()} != {want.item()}")
    assert not failures, "\n".join(failures)


def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, window_size):
    """A torch model of flash_attn_varlen_func (its documented semantics): each segment
    [cu[i], cu[i+1]) of the flattened tokens attends causally within itself, GQA by head
    groups, window_size=(left, 0) limiting keys to `left` back."""
    out = torch.empty_like(q)
    left = window_size[0]
    assert torch.equal(cu_q, cu_k)
    for a, z in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[a:z].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        n = z - a
        i = torch.arange(n)
        mask = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - left - 1) if left >= 0 else True)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                             enable_gqa=qs.shape[0] != ks.shape[0])
        out[a:z] = o.transpose(0, 1)
    assert causal and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    return out


def test_varlen_path_lays_documents_out_as_flash_attn_expects():
    from megaft.data.packed import cu_seqlens
    from megaft.models.attention.documents import segments, varlen_attend

    ids, labels, docs, _ = C.packed()
    cu, longest = segments(docs.doc_ids)
    assert torch.equal(cu.long(), cu_seqlens(docs.doc_ids).long())  # the data module's boundaries
    q = torch.randn(ids.shape[0], 4, C.SEQ, 8, generator=torch.Generator().manual_seed(0))
    k, v = (torch.randn(ids.shape[0], 2, C.SEQ, 8, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    for window in (None, 3):
        got = varlen_attend(q, k, v, docs, window, fn=torch_varlen)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs, window),
                                                                enable_gqa=True)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn's varlen kernel needs a CUDA GPU")
def test_flash_attn_varlen_equals_sdpa_on_gpu():
    from megaft.models.attention.documents import flash_available, varlen_attend

    if not flash_available(torch.device("cuda")):
        pytest.skip(reason="flash-attn is not installed")
    ids, labels, docs, _ = C.packed()
    docs = docs.to("cuda")
    q, k, v = (torch.randn(ids.shape[0], 4, C.SEQ, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = varlen_attend(q, k, v, docs, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs, None))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16: the kernels round differently
