"""Activation checkpointing (issue 13, part 1): model.recompute=selective|full changes no
number (loss and every gradient equal recompute=none bitwise, with dropout, packed
documents and the Triton kernels), applies to the first recompute_layers blocks of each
pipeline stage, trains at tp=2 with sequence parallel and at pp=2 like the single
process, and the memory estimate matches the bytes the forward really saves."""
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels, interpreted on CPU

from models.layout_runs import verify  # noqa: E402  (megaft-verify, its layout on the pooled ranks)

from megaft.config import Config  # noqa: E402
from megaft.config.kernels import KernelsConfig  # noqa: E402
from megaft.config.model import ModelConfig  # noqa: E402
from megaft.kernels import _triton  # noqa: E402
from megaft.models import saved  # noqa: E402
from megaft.models.attention.documents import Docs  # noqa: E402
from megaft.models.checks import check_model  # noqa: E402
from megaft.models.decoder import Decoder  # noqa: E402
from megaft.models.init import init_params  # noqa: E402
from megaft.perf.counts import activation_bytes_per_token  # noqa: E402
from megaft.pipeline.stage import StageModel  # noqa: E402
from megaft.validation import validate  # noqa: E402

MODES = ("selective", "full")


def tiny(**kw) -> ModelConfig:
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=64)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def loss_and_grads(cfg: ModelConfig, kernels=None, docs=None):
    model = Decoder(cfg, kernels=kernels)
    init_params(model, cfg, seed=1, tp_rank=0, tp_size=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)  # the dropout masks: recomputation must replay exactly these
    loss = model.loss_sum(ids, ids, docs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same(a, b, tag):
    assert torch.equal(a[0], b[0]), tag
    assert [n for n in a[1] if not torch.equal(a[1][n], b[1][n])] == [], tag


GEMMA2 = dict(sandwich_norms=True, attn_softcap=1.0, final_softcap=2.0, query_pre_attn_scalar=12.0, norm_offset=1.0,
              activation="gelu_pytorch_tanh", sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_recompute_changes_no_number(dropout, family):
    """Gemma 2's blocks too: sandwich norms, the explicit soft-capped core recomputed by
    `selective`, windows, the capped logits."""
    tiny_ = functools.partial(tiny, **({**GEMMA2, "n_layers": 4} if family == "gemma2" else {}))
    base = loss_and_grads(tiny_(dropout=dropout))
    for mode in MODES:
        assert_same(loss_and_grads(tiny_(dropout=dropout, recompute=mode)), base, mode)
    if family == "gemma2":
        return
    docs = Docs(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 0, 1]] * 2),
                torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 4, 4]] * 2))
    base = loss_and_grads(tiny(dropout=dropout), docs=docs)
    for mode in MODES:
        assert_same(loss_and_grads(tiny(dropout=dropout, recompute=mode), docs=docs), base, f"{mode} docs")


@pytest.mark.skipif(_triton.unavailable_reason(torch.device("cpu")) is not None,
                    reason=f"triton cannot run here: {_triton.unavailable_reason(torch.device('cpu'))}")
def test_recompute_with_the_fused_kernels():
    kernels = KernelsConfig(backend="triton", autotune=False)
    base = loss_and_grads(tiny(n_layers=1), kernels)
    for mode in MODES:
        assert_same(loss_and_grads(tiny(n_layers=1, recompute=mode), kernels), base, mode)


def test_recompute_layers_are_the_first_of_each_stage():
    model = Decoder(tiny(n_layers=4, recompute="full", recompute_layers=2))
    assert [b.full_recompute for b in model.layers] == [True, True, False, False]
    cfg = tiny(n_layers=6, recompute="selective", recompute_layers=1)
    # 6 blocks over pp=2 x vpp=2 stages: [0, 1] [2, 3] [4] [5]; rank 0 holds stages 0 and 2
    for rank, held, first in ((0, {"0", "1", "4"}, {"0", "4"}), (1, {"2", "3", "5"}, {"2", "5"})):
        stage = StageModel(cfg, pp=2, pp_rank=rank, vpp=2)
        assert set(stage.layers) == held
        assert {k for k, b in stage.layers.items() if b.self_attn.selective and b.mlp.selective} == first
        assert all(not b.full_recompute for b in stage.layers.values())
    assert check_model(tiny(recompute="sometimes"), 1)[0].startswith("model.recompute='sometimes' is unknown")
    assert "recompute_layers=-1" in check_model(tiny(recompute_layers=-1), 1)[0]


def saved_bytes(cfg: ModelConfig, seq: int = 32) -> int:
    """Bytes of the distinct non-parameter tensors the forward saves for backward."""
    model = Decoder(cfg)
    init_params(model, cfg, seed=1, tp_rank=0, tp_size=1)
    ids = torch.randint(0, cfg.vocab_size, (2, seq))
    return saved.saved_bytes(model, lambda: model.loss_sum(ids, ids))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_estimate_matches_the_saved_bytes(mode):
    # Per block and token: 4 vs 2 blocks at 64 vs 32 tokens per row (2 rows), so the
    # embedding, head and loss, and anything weight-sized, cancel out.
    measured = saved.block_bytes(lambda layers, seq: saved_bytes(
        tiny(dim=64, ffn_dim=128, n_layers=layers, recompute=mode), seq), 32) / 64
    cfg = tiny(dim=64, ffn_dim=128, recompute=mode)
    estimated = activation_bytes_per_token(cfg, tp=1, sequence_parallel=False, precision="fp32", recompute=mode)
    assert measured == pytest.approx(estimated, rel=0.02), (measured, estimated)  # exact in fp32
    if mode == "full":
        assert measured == estimated == cfg.dim * 4  # exactly the block's fp32 input


@pytest.mark.parametrize("seq", [32, 64])
def test_activation_estimate_matches_the_saved_bytes_of_gemma2_blocks(seq):
    """Sandwich norms and the explicit soft-capped attention, whose probabilities grow with the
    row: one block's bytes per token (2 blocks minus 1) against the estimate at that length;
    within 1% (the [seq, seq] causal mask, per row, is not counted)."""
    kw = dict(dim=64, ffn_dim=128, sandwich_norms=True, attn_softcap=5.0, norm_offset=1.0,
              activation="gelu_pytorch_tanh")
    measured = (saved_bytes(tiny(n_layers=2, **kw), seq) - saved_bytes(tiny(n_layers=1, **kw), seq)) / (2 * seq)
    estimated = activation_bytes_per_token(tiny(**kw), tp=1, sequence_parallel=False, precision="fp32", seq=seq)
    assert measured == pytest.approx(estimated, rel=0.01), (measured, estimated)
    plain = activation_bytes_per_token(tiny(dim=64, ffn_dim=128), tp=1, sequence_parallel=False, precision="fp32")
    assert estimated > plain + 4 * 4 * seq  # at least the fp32 scores of 4 heads per key


def test_validate_estimates_less_memory_with_recompute():
    from megaft.perf.memory import estimate_memory

    cfg = Config()
    cfg.parallel.tp, cfg.launcher.nproc = 1, 1
    assert validate(cfg, 1) == []
    acts = {}
    for mode in ("none", "selective", "full"):
        cfg.model.recompute = mode
        acts[mode] = estimate_memory(cfg, 1).activations
    assert acts["full"] < acts["selective"] <= acts["none"]


@pytest.mark.parametrize("layout", ["tp2_sp_full", "pp2_selective"])
def test_recompute_trains_like_the_single_process(tmp_path, layout):
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len = 32, 2, 4, 2, 64, 64
    m.recompute, m.dropout = ("full", 0.0) if layout.startswith("tp2") else ("selective", 0.0)
    cfg.data.task_train_size, cfg.data.task_eval_size, cfg.data.seq_len = 300, 8, 32
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 8
    cfg.launcher.nproc, cfg.verify.steps = 2, 3
    if layout.startswith("tp2"):
        cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, True
    else:
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = 1, 2, 1
    report = verify(cfg, str(tmp_path))  # megaft-verify, its layout on the pooled ranks
    assert report.passed, report.format()
