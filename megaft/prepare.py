"""`megaft-prepare`: tokenize the training data once into the prepared store.

    megaft-prepare data=chat data.path=conversations.jsonl model.init_from=/ckpt/Qwen2.5-7B-Instruct
    megaft-prepare train.objective=dpo data.path=pairs.jsonl model.init_from=/ckpt/sft   # preference pairs

A Hydra app over megaft-train's config tree (conf/train.yaml), so the overrides of a
training run prepare exactly the dataset that run reads. It checks the data settings
(every malformed record as FILE:LINE with its fix), prepares the cache with
data.prepare_workers processes and a progress bar, and prints the directory. Run it
on a login node before a sweep; running it again with nothing changed is a no-op.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from megaft.config import Config, ConfigError, compose_once, conf_dir, register_configs
from megaft.config.pref import check_pref, reads_pairs

register_configs()


def eos_token_id(init_from: Optional[str]):
    """config.json's eos_token_id of an HF checkpoint (what the trainer appends), else None."""
    path = os.path.join(init_from, "config.json") if init_from else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("eos_token_id")


def run(cfg: Config) -> str:
    """Validate the data settings, prepare (or find) the cache; returns its directory.
    Raises ConfigError listing every problem."""
    from megaft.config.data import data_sources
    from megaft.data.checks import check_data
    from megaft.data.prepare import prepare_dataset

    pairs = None
    if reads_pairs(cfg.train.objective):
        from megaft.pref.data import pair_source_problems as pairs
    problems = check_data(cfg.data, init_from=cfg.model.init_from, pairs=pairs)
    problems += check_pref(cfg.pref, cfg.train.objective)
    if cfg.model.init_from and not os.path.isdir(cfg.model.init_from):
        problems.append(f"model.init_from={cfg.model.init_from!r} is not a directory; fix: point it at "
                        "the Hugging Face checkpoint whose tokenizer and chat template to use")
    if not data_sources(cfg.data):
        problems.append("nothing to prepare: data.path and data.sources are unset (the generated task is "
                        "made in memory); fix: set data.path=FILE or data.sources=[{path: ..., weight: 1}]")
    if problems:
        raise ConfigError(problems)
    if reads_pairs(cfg.train.objective):  # the pairs a preference run reads (megaft.pref.store)
        from megaft.pref.store import prepare_pairs

        ds = prepare_pairs(cfg.data, init_from=cfg.model.init_from, eos_token_id=eos_token_id(cfg.model.init_from))
        counts = ds.manifest["counts"]
        print(f"megaft-prepare: {counts['pairs']} preference pairs, {counts['tokens']} tokens "
              f"({counts['prompts_cut']} with a prompt cut as TRL cuts it) in {ds.path}")
        return ds.path
    ds = prepare_dataset(cfg.data, init_from=cfg.model.init_from,
                         eos_token_id=eos_token_id(cfg.model.init_from), progress=True)
    counts = ds.manifest["counts"]
    print(f"megaft-prepare: {counts['documents']} documents, {counts['tokens']} tokens "
          f"({counts['targets']} with a loss) in {ds.path}")
    return ds.path


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")
def _hydra_main(dcfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dcfg)
    try:
        run(cfg)
    except ConfigError as exc:
        print(f"megaft-prepare: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValueError as exc:  # DataError: a record that fails to encode, named FILE:LINE
        print(f"megaft-prepare: {exc}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    compose_once(_hydra_main, sys.argv[1:])


if __name__ == "__main__":
    main()
