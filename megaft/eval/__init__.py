"""`megaft-eval`: lm-eval-harness (the `lm_eval` package) on a run's exported model.

checks (of `eval.*`, EvalConfig in megaft.config.eval, and of `train.then_eval`), model_dir (which HF
folder of a run dir is read, exporting the newest checkpoint when there is none), run
(lm_eval's simple_evaluate, RUN_DIR/eval/results.json), cli (the command), submit (the
dependent Slurm job of `train.then_eval`), tasks/ (two example tasks with local data).
docs/evaluation.md is the manual.
"""
