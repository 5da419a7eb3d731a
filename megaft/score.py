"""`megaft-score`: score a preference run's reference log-probs into pref.scores, or a distillation
run's top-k teacher into distill.scores (distill.top_k), and stop.

It is megaft-train with train.max_steps=0 (and nothing saved or exported): the run is built
at its layout, which scores every pair (or every target token) once and stores the result under its
fingerprint (megaft.pref.scores, megaft.distill.stored); the training runs of that fingerprint then
read it. A sweep through
the Slurm launcher queues this as one job per fingerprint by itself (megaft.launch.score_jobs).
"""
from __future__ import annotations

import sys

FIXED = ("train.max_steps=0", "train.save_every=0", "train.save_final=false", "train.export_hf=false",
         "train.then_eval=false", "train.sample_every=0")
FIXED += ("train.epochs=null",)  # max_steps=0 above: a recipe's train.epochs beside it would be refused


def main() -> int:
    args = sys.argv[1:]
    if not any(a.startswith(("pref.scores=", "distill.scores=")) for a in args):
        print("megaft-score: pref.scores=DIR (a preference reference) or distill.scores=DIR (a top-k teacher, with "
              "distill.top_k) is required: the folder the scores are stored in, which the training runs name too; "
              "fix: add pref.scores=DIR or distill.scores=DIR", file=sys.stderr)
        return 2
    keys = {f.split("=")[0] for f in FIXED}
    sys.argv = [sys.argv[0]] + [a for a in args if a.split("=")[0].lstrip("+") not in keys] + list(FIXED)
    from megaft.train import main as train

    train()
    return 0
