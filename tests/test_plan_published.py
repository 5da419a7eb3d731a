"""The published rows benchmarks.plan holds out: each row's model is the published model (its parameter
count), and a row published as TFLOP/s converts to tokens/s by its framework's own FLOP formula."""
import pytest

from benchmarks.plan import BLOOM_176B, bloom_config, bloom_tokens_per_s, gpt_oss_config
from megaft.perf.counts import flops_per_token, total_params


def test_gpt_oss_row_is_gpt_oss_120b():
    # OpenAI's gpt-oss model card: 116.83B parameters in all; megaft's shape lacks the attention sinks
    # and the q/k/v/o, router and expert biases (about 0.04B)
    assert total_params(gpt_oss_config().model) == pytest.approx(116.83e9, rel=1e-3)


def test_bloom_row_is_bloom_176b():
    # bigscience/bloom model card: 176,247,271,424 parameters; megaft's shape lacks the LayerNorm biases
    # and the embedding LayerNorm
    assert total_params(bloom_config().model) == pytest.approx(176_247_271_424, rel=1e-4)


def test_bloom_tflops_convert_by_megatron_deepspeeds_recompute_formula():
    # Megatron-DeepSpeed counts 4 passes per token under activation checkpointing (3 without): the
    # converted tokens/s times megaft's training FLOPs per token (3 passes, its own count) is 3/4 of
    # the published TFLOP/s, up to the two counts' treatment of attention and the head
    cfg = bloom_config()
    achieved = bloom_tokens_per_s() * flops_per_token(cfg.model, cfg.data.seq_len)
    assert achieved / (BLOOM_176B["tflops"] * 1e12) == pytest.approx(0.75, rel=0.01)
    assert cfg.model.recompute == "full"
