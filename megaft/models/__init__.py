"""Models built from megaft.layers, their configs, initialization and HF interop."""
from megaft.models.config import ModelConfig, check_model
from megaft.models.llama import Llama

__all__ = ["Llama", "ModelConfig", "check_model"]
