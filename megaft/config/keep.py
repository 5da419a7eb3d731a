"""What a finished run keeps (train.export_hf, lora.export_merged resolved).

Every run writes a checkpoint at its last step (RUN_DIR/checkpoints). train.export_hf=null
(auto, the default) also exports the final model to RUN_DIR/hf when the run starts from a
checkpoint (model.init_from) and ZeRO-3 does not shard it (that export is not supported yet:
megaft-chat / megaft-eval export the final checkpoint instead); true / false decide
explicitly. Under LoRA the export is the peft adapter (hf/) and, unless
lora.export_merged=false, the merged model (hf_merged/).
"""
from __future__ import annotations


def exports_hf(cfg) -> bool:
    """Whether the run of `cfg` (a Config) writes RUN_DIR/hf when it finishes."""
    if cfg.train.export_hf is not None:
        return bool(cfg.train.export_hf)
    return bool(cfg.model.init_from) and cfg.parallel.zero != 3


def exports_merged(cfg) -> bool:
    """Whether a LoRA run of `cfg` also writes the merged model RUN_DIR/hf_merged."""
    return cfg.lora.rank > 0 and exports_hf(cfg) and cfg.lora.export_merged is not False
