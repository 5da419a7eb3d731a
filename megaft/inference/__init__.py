"""Generation with a KV cache at the training layout (tp, pp): greedy and sampled decoding
(`generate`) and each attention kind's cache (`kv_cache`). Used by samples while training
(megaft.training.samples), megaft-chat and megaft-eval's runs. Import the modules directly."""
