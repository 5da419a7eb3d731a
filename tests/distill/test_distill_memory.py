"""The memory estimate counts distill.teacher (megaft.perf.memory.objective_terms): a whole fp32 model of
its own shape beside the student, equal to the bytes of the teacher a distill Trainer builds."""
from __future__ import annotations

import gc
import weakref

from models.hf_fixture import make_hf_llama

from distill.distill_cases import distill_config, make_bigger_teacher, write_sft
from megaft.models.decoder import Decoder
from megaft.parallel.grid import ParallelGrid
from megaft.perf.memory import estimate_ranks
from megaft.training.loop import Trainer
from megaft.validation import resolve


def _earlier_decoders() -> weakref.WeakSet:
    """The Decoders alive before a test builds its Trainer (another test's, not yet collected): not counted."""
    gc.collect()
    return weakref.WeakSet(m for m in gc.get_objects() if isinstance(m, Decoder))


def test_the_teacher_is_the_model_the_estimate_counts(tmp_path):
    ckpt, teacher, data = str(tmp_path / "student"), str(tmp_path / "teacher"), str(tmp_path / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_bigger_teacher(teacher)
    write_sft(data)
    cfg = resolve(distill_config(ckpt, teacher, data))
    (tmp_path / "run").mkdir()
    earlier = _earlier_decoders()
    trainer = Trainer(cfg, ParallelGrid.single(), str(tmp_path / "run"))
    gc.collect()
    student = trainer.parts.model
    others = [m for m in gc.get_objects() if isinstance(m, Decoder) and m is not student and m not in earlier]
    held = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in others]
    mine = sum(p.numel() * p.element_size() for p in student.parameters())
    est = estimate_ranks(cfg, 1)[0]
    assert len(held) == 1 and held[0] == est.frozen > mine  # the teacher's own shape, not the student's
    sft = cfg
    sft.train.objective = "sft"
    assert estimate_ranks(sft, 1)[0].frozen == 0


def test_the_time_model_prices_the_teachers_own_forward(tmp_path):
    """megaft.perf.time: the teacher's forward of every micro-batch at its own shape (a bigger teacher
    costs more than one of the student's shape), and the student's forward and backward as SFT's."""
    import dataclasses
    import os

    from omegaconf import OmegaConf

    from megaft.config import conf_dir
    from megaft.config.cluster import ClusterConfig
    from megaft.perf.time import step_cost

    ckpt, teacher, data = str(tmp_path / "student"), str(tmp_path / "teacher"), str(tmp_path / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_bigger_teacher(teacher)
    write_sft(data)
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(conf_dir(), "cluster", "h100.yaml")))
    fields.pop("defaults")
    cluster = ClusterConfig(**fields)
    big = resolve(distill_config(ckpt, teacher, data))
    same = resolve(distill_config(ckpt, ckpt, data))  # a teacher of the student's own shape
    sft = dataclasses.replace(big, train=dataclasses.replace(big.train, objective="sft"))
    compute = {name: step_cost(c, cluster, 1).terms["compute"] for name, c in
               (("big", big), ("same", same), ("sft", sft))}
    assert compute["sft"] < compute["same"] < compute["big"]


def test_a_stored_top_k_teacher_is_not_held(tmp_path):
    """distill.top_k: the teacher scores the corpus once while the Trainer is built and is freed; the
    estimate counts no teacher and no teacher forwards."""
    ckpt, teacher, data = str(tmp_path / "student"), str(tmp_path / "teacher"), str(tmp_path / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_bigger_teacher(teacher)
    write_sft(data)
    cfg = distill_config(ckpt, teacher, data)
    cfg.distill.top_k = 8
    cfg = resolve(cfg)
    (tmp_path / "run").mkdir()
    earlier = _earlier_decoders()
    trainer = Trainer(cfg, ParallelGrid.single(), str(tmp_path / "run"))
    gc.collect()
    others = [m for m in gc.get_objects() if isinstance(m, Decoder) and m is not trainer.parts.model
              and m not in earlier]
    assert others == []
    est = estimate_ranks(cfg, 1)[0]
    assert est.frozen == 0
    cfg.distill.top_k = None
    assert estimate_ranks(cfg, 1)[0].frozen > 0


def test_a_teacher_over_the_budget_is_refused_with_the_stored_top_k_fix(tmp_path):
    """A budget the student fits in alone but not beside its online teacher: validation refuses the run,
    naming the teacher's GiB and distill.top_k as a fix; the same run with distill.top_k passes; under pp2
    (where top_k is refused) the fix is not offered."""
    from megaft.perf.memory import GIB
    from megaft.validation import validate

    ckpt, teacher, data = str(tmp_path / "student"), str(tmp_path / "teacher"), str(tmp_path / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_bigger_teacher(teacher)
    write_sft(data)
    online = resolve(distill_config(ckpt, teacher, data))
    stored = resolve(distill_config(ckpt, teacher, data))
    stored.distill.top_k = 8
    with_teacher, without = estimate_ranks(online, 1)[0], estimate_ranks(stored, 1)[0]
    assert without.frozen == 0 and with_teacher.total - without.total >= with_teacher.frozen > 0
    budget = ((with_teacher.total + without.total) // 2, "a test budget")
    [problem] = [p for p in validate(online, 1, gpu_budget=budget) if "estimated memory" in p]
    assert f"distill.top_k=64 with distill.scores=DIR (the teacher, {with_teacher.frozen / GIB:.1f} GiB" in problem
    assert "frozen" in problem and "a test budget" in problem
    assert not [p for p in validate(stored, 1, gpu_budget=budget) if "estimated memory" in p]
    piped = resolve(distill_config(ckpt, teacher, data))
    piped.parallel.pp = 2
    over = [p for p in validate(piped, 2, gpu_budget=(1, "a test budget")) if "estimated memory" in p]
    assert over and "distill.top_k" not in over[0]
