"""The memory estimate under train.objective (megaft.perf.memory.objective_terms): a preference
pair is two rows, an online reference is a whole fp32 model beside the policy (tp/pp/ep
sharded, not ZeRO), and a DPO layout the SFT-style count let through is refused."""
from test_estimate import preset_1b

from megaft.perf.counts import FP32, rank_params
from megaft.perf.memory import MemoryEstimate, check_memory, estimate_memory


def sft_config():
    cfg = preset_1b(micro=1)
    cfg.parallel.zero = 3
    return cfg


def dpo(mode: str = "online"):
    cfg = sft_config()
    cfg.train.objective, cfg.pref.reference_mode = "dpo", mode
    return cfg


def test_pairs_are_two_rows_and_the_reference_is_a_whole_model():
    sft, pre, online = estimate_memory(sft_config(), 8), estimate_memory(dpo("precompute"), 8), \
        estimate_memory(dpo(), 8)
    assert sft.frozen == pre.frozen == 0
    # the activations scale with the tokens (minus the logits term, also per token): exactly twice
    assert pre.activations == 2 * sft.activations
    assert (pre.params, pre.grads, pre.optimizer) == (sft.params, sft.grads, sft.optimizer)
    assert online.frozen == rank_params(online_model := dpo().model, tp=1, pp=1, vpp=1)[0] * FP32
    assert online.frozen == 8 * online.params  # fp32 and whole under ZeRO-3 while the policy is sharded 8 ways
    assert online_model.vocab_size == 128256


def test_the_old_count_passed_a_cap_the_dpo_run_exceeds():
    cfg = dpo()
    est = estimate_memory(cfg, 8)
    old = MemoryEstimate(est.rank, est.params, est.grads, est.optimizer, est.activations // 2, est.buffers)
    cap = (old.total + est.total) / 2
    cfg.launcher.gpu_mem_gb = cap / 2 ** 30
    assert old.total < cap < est.total
    problems = check_memory(cfg, 8)
    assert len(problems) == 1 and "frozen" in problems[0], problems


def test_a_reward_pair_is_two_rows_with_no_other_model():
    reward = sft_config()
    reward.train.objective = "reward"
    got, pre = estimate_memory(reward, 8), estimate_memory(dpo("precompute"), 8)
    assert got.frozen == 0 and got.activations == pre.activations > estimate_memory(sft_config(), 8).activations
