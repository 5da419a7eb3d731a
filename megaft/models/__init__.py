"""Models built from megaft.layers: the `Decoder` (decoder.py) for every family (arch/), its
attention (attention/), mixtures of experts (moe/), HF import and export (hf/), initialization
and recompute. Import the modules directly."""
