"""The memory estimate counts distill.teacher (megaft.perf.memory.objective_terms): a whole fp32 model of
its own shape beside the student, equal to the bytes of the teacher a distill Trainer builds."""
from __future__ import annotations

import gc

from models.hf_fixture import make_hf_llama

from distill.distill_cases import distill_config, make_bigger_teacher, write_sft
from megaft.models.decoder import Decoder
from megaft.parallel.grid import ParallelGrid
from megaft.perf.memory import estimate_ranks
from megaft.training.loop import Trainer
from megaft.validation import resolve


def test_the_teacher_is_the_model_the_estimate_counts(tmp_path):
    ckpt, teacher, data = str(tmp_path / "student"), str(tmp_path / "teacher"), str(tmp_path / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_bigger_teacher(teacher)
    write_sft(data)
    cfg = resolve(distill_config(ckpt, teacher, data))
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, ParallelGrid.single(), str(tmp_path / "run"))
    gc.collect()
    student = trainer.parts.model
    others = [m for m in gc.get_objects() if isinstance(m, Decoder) and m is not student]
    held = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in others]
    mine = sum(p.numel() * p.element_size() for p in student.parameters())
    est = estimate_ranks(cfg, 1)[0]
    assert len(held) == 1 and held[0] == est.frozen > mine  # the teacher's own shape, not the student's
    sft = cfg
    sft.train.objective = "sft"
    assert estimate_ranks(sft, 1)[0].frozen == 0
