"""`megaft-report DIR`: one table row per run of a run dir or a sweep dir.

The command line of the megaft.report package (its docstring tells what the columns mean):
arguments checked once before any run is read, the rows collected, a scaling study's and
the communication prediction's columns added, the table printed and the files written.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megaft.report.collect import collect
from megaft.report.render import format_table, write_outputs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaft-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a run dir or a multirun/sweep dir")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s per GPU for MFU (default: the run's train.peak_tflops, else its "
                             "GPU's dense peak at its precision)")
    parser.add_argument("--out", default=None, help="where report.* go (default: DIR)")
    parser.add_argument("--no-plot", action="store_true", help="skip report.png and curves.png")
    parser.add_argument("--commbench", default=None, metavar="RUN_DIR",
                        help="a megaft-commbench run dir (or its commbench.json): add each run's communication "
                             "share predicted from the measured bandwidth (megaft.plan.run_comm)")
    parser.add_argument("--cluster", default=None, metavar="PRESET",
                        help="with --commbench, the conf/cluster preset for runs that ran without cluster=...")
    return parser


def _comm_arguments(args: argparse.Namespace):
    """(cluster preset or None, problems) of --commbench/--cluster."""
    from megaft.config.cluster import ClusterConfig
    from megaft.plan.run_comm import check_commbench, preset_cluster

    try:
        cluster = preset_cluster(args.cluster) if args.cluster else None
    except ValueError as exc:
        return None, [str(exc)]
    problems = ([] if args.commbench else ["--cluster goes with --commbench; fix: add --commbench <a "
                                            "megaft-commbench run dir>"])
    problems += check_commbench(args.commbench, cluster or ClusterConfig()) if args.commbench else []
    return cluster, problems


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"megaft-report: {args.dir} is not a directory", file=sys.stderr)
        return 1
    cluster = None
    if args.commbench or args.cluster:  # checked once, before any run is read
        cluster, problems = _comm_arguments(args)
        if problems:
            print("megaft-report: " + "\n".join(problems), file=sys.stderr)
            return 2
    rows = collect(args.dir, args.peak_tflops)
    from megaft.scale.study import read_study

    study = read_study(args.dir)  # a megaft-scale sweep: speedup, efficiency and comm share columns
    if study and rows:
        from megaft.scale.report import add_scaling

        add_scaling(rows, args.dir, study)
    if not rows:
        print(f"megaft-report: no runs under {args.dir} (no summary.json, metrics.jsonl, config.yaml, .hydra/ or "
              "submitted.json)", file=sys.stderr)
        return 1
    comparison = None
    if args.commbench and rows:
        from megaft.plan.run_comm import add_comm, prediction_line

        comparison = prediction_line(add_comm(rows, args.dir, args.commbench, cluster))
    print(format_table(rows))
    if comparison:
        print(comparison)
    paths = write_outputs(rows, args.out or args.dir, plot=not args.no_plot, study=study)
    if not args.no_plot:  # every run's loss curves on one figure (megaft.report.curves)
        from megaft.report.curves import plot_curves

        paths += plot_curves(rows, args.dir, args.out or args.dir)
    for path in paths:
        print(f"wrote {path}")
    return 0
