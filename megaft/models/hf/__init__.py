"""Hugging Face interop for the families of megaft.models.arch (Llama 2/3.x, Qwen2/2.5,
Qwen3, Mistral, Gemma): import a checkpoint directory, export one in its own family.

An HF checkpoint is a directory with config.json, model.safetensors (or shards
listed in model.safetensors.index.json) and tokenizer.json. Parameter names map
one to one: ours plus a `model.` prefix, except `lm_head.weight` (absent when the
embeddings are tied); each family's spec owns its map (ArchSpec.hf_name). Import
reads each rank's slice only (load.py); export gathers over tp and one rank
writes (export.py); kv heads replicated over tp > n_kv_heads are written once.

    cfg = hf_model_config(path, base=cfg)            # shapes from config.json
    model = Decoder(cfg, group=grid.tp_group)
    load_hf_weights(model, path, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    ...
    export_hf(model, cfg, out, tokenizer_json=path, tp_group=grid.tp_group,
              is_writer=grid.rank == 0)               # every tp rank calls it

Rope parameters: transformers 5 writes `rope_parameters: {rope_type, rope_theta,
...}`; older configs have top-level `rope_theta` and `rope_scaling`. Both are read;
export writes both, so transformers 4 and 5 load the result.
"""
