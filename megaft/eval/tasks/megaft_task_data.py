"""Loaders of the example tasks' data (the .jsonl files beside this module), named in the
task YAMLs as `custom_dataset: !function megaft_task_data.<name>`. lm_eval imports this
file from the YAML's folder and calls the loader with the task's metadata and
dataset_kwargs; reading the file here, by a path relative to this module, keeps the
tasks working from any working directory and without the network."""
import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def jsonl_split(file: str, split: str = "test") -> datasets.DatasetDict:
    """The rows of `file` (beside this module, or an absolute path) as one split."""
    with open(os.path.join(HERE, file)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def arith(**kwargs) -> datasets.DatasetDict:
    """megaft_arith: one-digit sums, four choices each."""
    return jsonl_split("megaft_arith.jsonl")


def copy(**kwargs) -> datasets.DatasetDict:
    """megaft_copy: repeat a word after `copy <word> = `."""
    return jsonl_split("megaft_copy.jsonl")
