"""Logit distillation (train.objective=distill): TRL's generalized JSD between a frozen teacher's and
the student's next-token distributions, vocab-parallel (megaft.distill.losses)."""
