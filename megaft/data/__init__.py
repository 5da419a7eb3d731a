"""Data: tokenizers, JSONL examples, loss masks, packing, eval batches, generated tasks.

The trainer's path through it:

    problems = check_data(cfg, init_from=...)          # once, in the launcher
    tok = build_tokenizer(cfg, init_from=...)
    eos_id, pad_id = special_ids(tok, eos_token_id)    # eos_token_id from an HF config.json
    train, eval_, task = load_examples(cfg)
    stream = PackedStream(encode_examples(tok, train, eos_id), cfg.seq_len, cfg.seed)
    input_ids, labels = stream.global_batch(step, global_batch_size)   # same on every rank
    batches = eval_batches(encode_examples(tok, eval_, eos_id), batch_size, pad_id)

Fine-tuning data (issue 12): conversations, sources, the prepared store, packing
that keeps documents apart:

    ds = prepare_dataset(cfg, init_from=..., eos_token_id=...)   # memory-mapped; prepared once
    if cfg.packing == "stream":
        stream = PackedStream(ds.to_encoded(weights, cfg.seed), cfg.seq_len, cfg.seed)
    else:                                                       # docs | none
        stream = PackedDocs(ds, cfg.seq_len, cfg.seed, pad_id=pad_id, packing=cfg.packing,
                            long_docs=cfg.long_docs, weights=[s.weight for s in data_sources(cfg)])
    input_ids, labels = stream.global_batch(step, n)
    batch = stream.doc_batch(step, n)    # + position_ids, doc_ids, cu_seqlens of the same rows
    chat = chat_encoder(cfg, tok, init_from=...)                # in-memory: encode_examples(..., chat=chat)
"""
