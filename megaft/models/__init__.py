"""Models built from megaft.layers, their configs, initialization and HF interop."""
from megaft.models.config import ModelConfig, check_model
from megaft.models.decoder import Decoder

__all__ = ["Decoder", "ModelConfig", "check_model"]
