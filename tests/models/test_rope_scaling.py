"""megaft.models.attention.rope.rope_init against transformers' ROPE_INIT_FUNCTIONS (the
specification) for every supported rope_type, on the parameter sets real checkpoints
use and the corner cases of yarn (mscale pairs, no truncation, factor from the context
ratio). Same float ops in the same order: the tables must be bit-identical."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megaft.models.attention.rope import rope_init

HEAD_DIM, MAX_POS = 64, 4096
CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},  # Qwen2.5 long context
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 512, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 1.25,
     "truncate": False},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024},  # ratio of contexts
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p['rope_type']}-{len(p)}")
def test_rope_init_equals_transformers(params):
    theta = 50000.0
    hf = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                                  rope_parameters={**params, "rope_theta": theta})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, None)
    inv, factor = rope_init(HEAD_DIM, theta, params, MAX_POS)
    assert torch.equal(inv, want_inv), (inv - want_inv).abs().max()
    assert factor == want_factor
