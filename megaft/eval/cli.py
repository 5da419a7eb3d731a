"""`megaft-eval RUN_DIR|HF_DIR eval.tasks=[...]`: lm-eval-harness on a run's model (a reward
model's pairwise accuracy with eval.pairs=FILE, megaft.eval.pairwise).

Arguments after the folder are `eval.*` overrides in Hydra's syntax (eval.tasks=[a,b],
eval.include=DIR, eval.batch_size=8, eval.device=cpu, eval.limit=N); a run dir's own
config.yaml is not needed. Exit status: 0 results written, 1 lm_eval failed, 2 a bad
argument or nothing to evaluate (unknown task, no checkpoint, lm_eval not installed).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megaft.cli_args import checked_arguments
from megaft.config.eval import EvalConfig
from megaft.eval.checks import check_eval, tasks_dir
from megaft.eval.model_dir import EvalError, locate

PREFIX = "eval."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaft-eval", description=__doc__.split("\n\n")[0],
                                     epilog=f"example tasks: {tasks_dir()} (megaft_arith, megaft_copy)")
    parser.add_argument("dir", help="a run dir (its hf/, hf_merged/ or newest checkpoint) or an HF checkpoint folder")
    parser.add_argument("overrides", nargs="*", metavar="eval.KEY=VALUE",
                        help="eval.tasks=[megaft_arith,megaft_copy] eval.include=DIR eval.batch_size=8 ...")
    return parser


def parse_overrides(overrides: list[str]) -> EvalConfig:
    """EvalConfig from `eval.key=value` strings (typed by the dataclass); ValueError on a bad one."""
    bad = [o for o in overrides if not o.startswith(PREFIX) or "=" not in o]
    if bad:
        raise ValueError(f"not an eval.KEY=VALUE override: {' '.join(bad)}")
    schema = OmegaConf.structured(EvalConfig)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.from_dotlist([o[len(PREFIX):] for o in overrides]))
    except OmegaConfBaseException as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
    return OmegaConf.to_object(merged)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    cfg = checked_arguments("megaft-eval", lambda: parse_overrides(args.overrides), check_eval)
    if cfg is None:
        return 2
    from megaft.eval.run import evaluate, import_lm_eval

    try:
        if cfg.pairs is None:
            import_lm_eval()
        target = locate(args.dir)
        what = f"pairwise accuracy of {cfg.pairs}" if cfg.pairs is not None else ", ".join(cfg.tasks)
        print(f"megaft-eval: {what} on {target.hf_dir} ({target.origin})", flush=True)
        record = evaluate(target, cfg)
    except EvalError as exc:
        print(f"megaft-eval: {exc}", file=sys.stderr)
        return 2
    if record and cfg.pairs is not None:
        pairwise = record["results"]["pairwise"]
        print(f"megaft-eval: accuracy {pairwise['accuracy']:.4f} (margin {pairwise['margin']:.4f}) on "
              f"{pairwise['pairs']} pairs; wrote {os.path.join(target.out_dir, 'results.json')}")
    elif record:
        from lm_eval.utils import make_table

        print(make_table(record))
        print(f"megaft-eval: wrote {os.path.join(target.out_dir, 'results.json')}")
    return 0
