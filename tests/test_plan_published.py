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


def test_bloom_row_is_the_launch_scripts_layout():
    # bigscience tr11-176B-ml.slurm: 48 nodes x 8, TP 4, PP 12, MBS 2, GBS 2048, seq 2048, vocab padded to 250880;
    # the BLOOM blog: 72 pipeline partitions, the embedding and the tied head one each, no sequence parallelism
    from megaft.pipeline.partition import stage_layer_counts

    cfg = bloom_config()
    par = cfg.parallel
    assert (par.tp, par.pp, par.dp, par.tp * par.pp * par.dp) == (4, 12, 8, 384)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.data.seq_len) == (2, 2048, 2048)
    assert cfg.model.vocab_size == 250880 and not par.sequence_parallel
    counts = stage_layer_counts(cfg.model.n_layers, par.pp, par.pp_layers)
    # 72 partitions of 6: the end stages give one partition to the embedding or the head
    assert [c + (s in (0, par.pp - 1)) for s, c in enumerate(counts)] == [6] * 12


def test_gpt_oss_row_accumulates_what_its_layout_implies():
    # the table prints GA 2, which its own 64 GPUs / pp 4 / MBS 4 / GBS 512 cannot give: dp 16 accumulates 8
    from megaft.config.train import accumulation_steps

    cfg = gpt_oss_config()
    assert cfg.parallel.dp == 16
    assert accumulation_steps(cfg.train, cfg.parallel.dp) == 8
