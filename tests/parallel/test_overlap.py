"""parallel.tp_overlap=ring: the ring collective matmuls equal the plain sequence-parallel path
(tests/parallel/overlap_cases.py) at tp=4 and at tp=2 groups inside a world of 4; validation
refuses the layouts the ring does not cover, naming the fix. (The whole model with the ring
vs the single process: tests/parallel/tp_cases.py; a training curve: tests/test_training.py.)"""
import pytest
from multirank import spawn

from parallel import overlap_cases


@pytest.mark.exact  # tolerances of reassociation, which hold on the pinned CPU code path too
def test_ring_column_row_pair_matches_plain_sequence_parallel():
    spawn(4, overlap_cases.run_all)


def _config(experts: int = 0, **parallel):
    """A tiny Llama (or Mixtral of `experts` experts) on tp=2 with sequence parallel and the ring."""
    from megaft.config import Config
    from megaft.config.model import ModelConfig

    cfg = Config()
    moe = dict(arch="mixtral", n_experts=experts, top_k=2) if experts else {}
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50,
                            max_seq_len=256, **moe)
    cfg.data.seq_len, cfg.device = 32, "cpu"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 8
    settings = {**dict(tp=2, sequence_parallel=True, tp_overlap="ring"), **parallel}
    for key, value in settings.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _overlap(cfg, world: int) -> list[str]:
    from megaft.validation import validate

    return [p for p in validate(cfg, world) if "tp_overlap" in p]


def test_ring_layout_is_valid_and_tp1_is_a_no_op():
    assert _overlap(_config(), 2) == []
    assert _overlap(_config(tp=1, sequence_parallel=False), 1) == []  # a sweep over tp=1,2,4 keeps the setting


@pytest.mark.parametrize("change, world, words", [
    (dict(sequence_parallel=False), 2, ["sequence_parallel=false", "fix: parallel.sequence_parallel=true"]),
    (dict(cp=2), 4, ["parallel.cp=2", "fix: parallel.cp=1"]),
    (dict(experts=4), 2, ["mixture-of-experts", "fix: parallel.tp_overlap=none"]),
])
def test_unsupported_layouts_are_refused_with_the_fix(change, world, words):
    problems = _overlap(_config(**change), world)
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems


def test_fused_linear_kernels_are_refused():
    cfg = _config()
    cfg.kernels.linear = "triton"
    problems = _overlap(cfg, 2)
    assert len(problems) == 1 and "kernels.linear=triton" in problems[0] and "fix: kernels.linear=torch" in problems[0]
