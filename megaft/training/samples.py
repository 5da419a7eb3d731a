"""Samples while training (`train.sample_every`, `sample.*`): generations from the model
being trained, at its training layout, written to run_dir/samples.jsonl and TensorBoard.

`sample.prompts` is a JSONL file, one prompt per line: `{"prompt": str}` is encoded as
is (as a prompt/completion example's prompt is), `{"messages": [...]}` is rendered with
the run's chat template and its generation prompt (transformers'
apply_chat_template(..., add_generation_prompt=True)). At step 0 (when the run did not
resume), every `train.sample_every` steps and at the last step, every rank generates
every prompt (megaft.inference.generate: KV cache, greedy or sampled with
`sample.temperature`/`sample.top_p`, the draws seeded by (sample.seed, step), identical
on every rank) through the model as it trains: tp, sequence parallel, pp stages, cp
replicas, LoRA adapters; under ZeRO-3 with the whole layers gathered, as evaluation
does. Rank 0 appends one line per prompt, {"step", "prompt", "text"}, and the same
text to TensorBoard (tag samples/<i>).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional, Union

from megaft.checkpoint.state import trim_metrics
from megaft.config.train import SampleConfig
from megaft.data.prompts import read_prompts, render_prompt
from megaft.inference.generate import Sampling, generate, pipeline_generate
from megaft.models.decoder import Decoder


def opening(text: str, words: int = 6) -> str:
    """The first words of a sample, for the progress bar."""
    return " ".join(text.split()[:words])[:60]


class Sampler:
    """Generates every prompt of `sample.prompts` at a step and records the texts (rank 0)."""

    def __init__(self, cfg: SampleConfig, *, tokenizer, template, eos_id: Union[int, list[int], None], run_dir: str,
                 is_writer: bool, text: Optional[Callable[[int, str, str], None]] = None):
        self.cfg, self.tok, self.eos_id, self.is_writer, self.text = cfg, tokenizer, eos_id, is_writer, text
        self.sampling = Sampling(cfg.temperature, cfg.top_p, cfg.seed)
        self.path = os.path.join(run_dir, "samples.jsonl")
        items = read_prompts(cfg.prompts)
        self.prompts = [render_prompt(item, template) for item in items]
        # a conversation's rendered text holds its special tokens (megaft.data.chat encodes it so); a prompt is
        # encoded as a prompt/completion example's prompt is (megaft.data.encode)
        self.ids = [tokenizer.encode(p, add_special_tokens="prompt" in item).ids
                    for p, item in zip(self.prompts, items)]

    def resumed_at(self, step: int) -> None:
        """Drop lines of steps after the checkpoint a run resumes from (rank 0)."""
        if self.is_writer:
            trim_metrics(self.path, step)

    def run(self, generator, step: int, *, device, autocast) -> list[dict]:
        """Generate at `step` through `generator` (a Decoder, or a PipelineRuntime under pp);
        collective over the model's groups. Returns the lines (every rank), writes them (rank 0)."""
        kw = dict(max_new_tokens=self.cfg.max_new_tokens, eos_id=self.eos_id, sampling=self.sampling, step=step)
        if isinstance(generator, Decoder):
            with autocast():
                outs = generate(generator, self.ids, device=device, **kw)
        else:
            outs = pipeline_generate(generator, self.ids, autocast=autocast, **kw)
        lines = [{"step": step, "prompt": p, "text": self.tok.decode(ids)} for p, ids in zip(self.prompts, outs)]
        if self.is_writer:
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
            if self.text is not None:
                for i, line in enumerate(lines):
                    self.text(step, f"samples/{i}", f"{line['prompt']}\n\n→ {line['text']}")
        return lines
