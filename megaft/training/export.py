"""The export part: the trained model written for other tools when a run finishes
(train.export_hf): a Hugging Face directory in run_dir/hf, or with LoRA a peft adapter
folder in hf/ and the merged model in hf_merged/ (megaft.peft.export)."""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.protocols import DataPart, RunParts


class HFExport:
    """Writes the model of a finished run. Under pp each stage's tp rank 0 (first dp×cp
    replica) writes its own tensors; rank 0 writes the tokenizer when it came from no file."""

    def __init__(self, cfg: Config, grid: ParallelGrid, run_dir: str, model: torch.nn.Module, data: DataPart):
        self.cfg, self.grid, self.run_dir, self.model, self.data = cfg, grid, run_dir, model, data

    def save_own_tokenizer(self) -> None:
        """RUN_DIR/tokenizer.json when the run's tokenizer comes from no file (data.task's
        character vocabulary), written when the run starts: megaft-chat / megaft-eval read it
        with any checkpoint of the run."""
        if not (self.cfg.data.tokenizer or self.cfg.model.init_from) and self.grid.rank == 0:
            self.data.tokenizer.save(os.path.join(self.run_dir, "tokenizer.json"))

    def _tokenizer_json(self) -> Optional[str]:
        from megaft.data.tokenizer import tokenizer_file

        if self.cfg.data.tokenizer or self.cfg.model.init_from:
            return tokenizer_file(self.cfg.data.tokenizer or self.cfg.model.init_from)
        self.save_own_tokenizer()
        return os.path.join(self.run_dir, "tokenizer.json") if self.grid.rank == 0 else None

    def write(self) -> None:
        from megaft.models.hf.export import export_hf

        cfg, grid = self.cfg, self.grid
        tok_json = self._tokenizer_json()
        writer = grid.tp_rank == 0 and grid.replica_rank == 0
        if hasattr(self.model, "vlm"):  # a vision-language model: Gemma 3's or Qwen2.5-VL's published layout
            from megaft.models.vision.hf import export_vision_language

            out = os.path.join(self.run_dir, "hf")
            # a run finished again replaces its export, as export_hf does (the first stage's writer writes it)
            if writer and grid.pp_rank == 0 and os.path.isdir(out):
                shutil.rmtree(out)
            if cfg.lora.rank > 0:  # a peft adapter of the *ForConditionalGeneration (validation: no merged model)
                from megaft.peft.vision import export_vision_adapter

                export_vision_adapter(self.model, cfg.lora, out, tp_group=grid.tp_group, is_writer=writer,
                                      base=cfg.model.init_from, pp_group=grid.pp_group)
                return
            export_vision_language(self.model, out, tokenizer_json=tok_json, tp_group=grid.tp_group,
                                   is_writer=writer, pp_group=grid.pp_group)
            return
        if cfg.lora.rank > 0:  # a peft adapter folder in hf/ (+ the merged model in hf_merged/)
            from megaft.peft.export import export_lora

            export_lora(self.model, cfg.model, cfg.lora, self.run_dir, tokenizer_json=tok_json,
                        tp_group=grid.tp_group, pp_group=grid.pp_group, is_writer=writer)
            return
        export_hf(self.model, cfg.model, os.path.join(self.run_dir, "hf"), tokenizer_json=tok_json,
                  tp_group=grid.tp_group, pp_group=grid.pp_group, is_writer=writer)


def build_export(parts: RunParts) -> HFExport:
    return HFExport(parts.cfg, parts.grid, parts.run_dir, parts.model, parts.data)
