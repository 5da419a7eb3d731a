"""Attention and what it is made of: grouped-query attention (`gqa`: the Llama block's, with
sliding windows, qk-norm and soft-capping), multi-head latent attention (`mla`, DeepSeek-V3),
rotary embeddings (`rope`), soft-capped scores (`softcap`, Gemma 2), kv heads replicated when
tp is wider than them (`kv_heads`), and packed documents' positions and masks (`documents`).
Import the modules directly."""
