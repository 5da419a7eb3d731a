"""Models built from megaft.layers, their configs, initialization and HF interop."""
from megaft.config.model import ModelConfig
from megaft.models.checks import check_model
from megaft.models.decoder import Decoder

__all__ = ["Decoder", "ModelConfig", "check_model"]
