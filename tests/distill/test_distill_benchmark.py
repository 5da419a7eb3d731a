"""benchmarks/distill.py at a tiny size: megaft's chunked loss and TRL's gathered one agree (loss and
the head's gradient), the check catches a gathered loss at another beta, the peak it reports is the
allocator's (an exact sequence of allocations), and with several chunks megaft's peak is the lower.
No timing or memory figure of a real size is asserted."""
import dataclasses

import pytest
import torch

from benchmarks import distill as bench

pytest.importorskip("trl.experimental.gkd")
TINY = bench.Head(tokens=96, vocab=300, hidden=16, teacher_hidden=24, chunk=16)


def test_peak_bytes_is_the_running_maximum_of_the_allocations():
    def held():
        a = torch.empty(250_000)  # 1e6 bytes
        b = torch.empty(500_000)  # 2e6 bytes, 3e6 held
        del a, b
        c = torch.empty(625_000)  # 2.5e6 bytes
        return c.numel()

    peak, out = bench.peak_bytes(held)
    assert out == 625_000 and peak == 3_000_000


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_and_gathered_agree_and_the_chunked_holds_less(beta):
    h = dataclasses.replace(TINY, beta=beta, temperature=2.0)
    runs = {v: bench.measure(v, h) for v in bench.VARIANTS}
    assert bench.disagreements(runs) == []
    assert runs["gathered"]["grad"].abs().max() > 0
    assert runs["megaft"]["peak_bytes"] < runs["gathered"]["peak_bytes"]
    wrong = dict(runs, gathered=bench.measure("gathered", dataclasses.replace(h, beta=0.25)))
    assert any("megaft loss" in p for p in bench.disagreements(wrong))


RUN = bench.Run(hidden=32, layers=1, teacher_layers=2, heads=2, kv_heads=1, intermediate=48, vocab=96, rows=8,
                prompt=(3, 8), completion=(3, 8), batch=4, micro=2, lr=1e-2)


def test_megaft_step_and_trl_gkd_agree_and_another_beta_is_caught(tmp_path):
    """Two steps (2 micro-batches each, AdamW between): megaft's distill Trainer and TRL's GKDTrainer on
    megaft's rows give the same loss and step-1 grad norm (1e-4), and a TRL run at another beta is caught."""
    import dataclasses as dc

    from benchmarks.preference import quiet

    quiet()
    inputs = bench.write_run(str(tmp_path), RUN)
    batches = bench.megaft_batches(inputs, RUN, 2, str(tmp_path / "order"))
    turns = {v: bench.run_step_turn(v, inputs, batches, RUN, 2, str(tmp_path)) for v in bench.STEP_VARIANTS}
    assert bench.step_disagreements(turns, 2) == []
    assert turns["megaft"].losses[0] != turns["megaft"].losses[1]  # the weights moved between the steps
    other = bench.run_step_turn("trl", inputs, batches, dc.replace(RUN, beta=0.9), 2, str(tmp_path))
    assert any("trl step 1" in p for p in bench.step_disagreements({"megaft": turns["megaft"], "trl": other}, 2))
