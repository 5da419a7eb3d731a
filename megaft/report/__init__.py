"""`megaft-report DIR`: one table row per run of a run dir or a sweep dir.

Reads each run's summary.json (megaft.training.summary.RunSummary, any schema version)
and metrics.jsonl, the sweep's submitted.json (job ids, invalid points with their
problems) and, when Slurm answers, `squeue` (sacct is not needed). Prints the table,
writes report.csv, report.json, report.md and a plot report.png (tokens/s and peak memory
per config) into DIR (or --out), and curves.png: every run's training and eval loss
against the step on one figure, its points stored with it (megaft.report.curves).

Status: invalid (rejected before submission), pending / running (in squeue, or for
runs Slurm does not know: no metrics yet / metrics but no summary), done (summary.json),
failed (a submitted job that left squeue without a summary; the reason comes from
submitit's result pickle or the job's stderr).

MFU = tokens/s * model FLOPs per token / (ranks * peak FLOP/s), from megaft.perf.counts
(the PaLM paper's count: matmuls forward and backward plus attention scores and values).
The peak is --peak-tflops, else the run's train.peak_tflops, else the dense peak of the
run's GPU at its precision; runs on CPU without a given peak show "-". The phase columns
(forward/backward/optimizer/comm seconds per step) are means over the train lines of
metrics.jsonl after the first (warm-up) step. The kernels column is summary.json's
`kernels` record in short: the one backend every op ran, else `backend(op,...)` groups
(why each was chosen, and the measured times, stay in summary.json).

A scaling study's sweep dir (`megaft-scale`, with scale.json) gets the columns nodes,
step_s, steady_tokens_per_s, speedup, ideal, efficiency and comm_share, and scaling.png
(measured against ideal speedup); megaft.scale.report defines them.

`--commbench <megaft-commbench run dir>` adds comm_share (measured, as above), pred_comm_s
and pred_comm_share: what the cost model predicts for each finished run's config as it
ran (its config.yaml: after an elastic change or a re-plan, the layout that ran) when the
links are the measured ones (megaft.plan.run_comm; `--cluster <preset>` for runs that ran
without `cluster=`).

A run with megaft-eval's RUN_DIR/eval/results.json gets one column per task metric,
`<task>/<metric>` (megaft.report.evalscores; docs/evaluation.md).

The package: `collect` (finding runs, their numbers and MFU), `status` (squeue, submitit's
pickles, a run's status), `render` (the table and the files), `curves` (curves.png), `cli` (the command).
"""
from megaft.report.cli import main
from megaft.report.collect import COLUMNS, collect, find_runs, kernels_cell, run_mfu
from megaft.report.render import columns, format_table, plot_rows, short_overrides, write_outputs
from megaft.report.status import failure_reason, run_status, squeue_states

__all__ = ["COLUMNS", "collect", "columns", "failure_reason", "find_runs", "format_table", "kernels_cell", "main",
           "plot_rows", "run_mfu", "run_status", "short_overrides", "squeue_states", "write_outputs"]
