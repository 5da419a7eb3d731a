"""benchmarks/rl.py on a tiny model and 8 prompts: megaft's GRPO and TRL's GRPOTrainer, fed the
same rollouts, agree over two steps (loss and grad norm within 1e-4: the accumulation of 2
micro-batches and an AdamW step), and the check catches TRL with another loss_type. Seconds;
no timing is asserted."""
import dataclasses

import pytest

from benchmarks import rl as bench
from benchmarks.preference import Sizes, write_model

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*rollout_func.*:UserWarning")
TINY = Sizes(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=48, vocab=96)
ROLLOUTS = bench.Rollouts(prompts=8, generations=4, prompt=(3, 9), completion=(2, 8))
SETTINGS = bench.Settings(batch=8, micro=4, lr=1e-2)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rl_bench"))
    bench.quiet()
    path = f"{root}/rollouts.jsonl"
    seq_len = 8 * -(-bench.write_rollouts(path, ROLLOUTS) // 8)
    write_model(f"{root}/ckpt", TINY, seq_len)
    return (f"{root}/ckpt", path, seq_len), root


def test_megaft_and_trl_agree_and_a_wrong_loss_type_is_caught(inputs):
    args, root = inputs
    turns = {v: bench.run_turn(v, args, ROLLOUTS, SETTINGS, 2, root) for v in bench.VARIANTS}
    assert bench.disagreements(turns, 2) == []
    assert turns["megaft"].losses[0] != turns["megaft"].losses[1]  # the weights moved between the steps
    other = dataclasses.replace(SETTINGS, loss_type="dr_grpo")
    wrong = {"megaft": turns["megaft"], "trl": bench.run_turn("trl", args, ROLLOUTS, other, 2, root)}
    assert any("trl step 1" in p for p in bench.disagreements(wrong, 2))
