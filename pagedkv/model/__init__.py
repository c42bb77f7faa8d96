"""The model layer: ``ModelConfig``, the Llama-family forward on flat batches, and loading
(GGUF / HF safetensors, tokenizer, weight cache)."""

from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel, load_config, load_model, resolve_model_path

__all__ = [
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "load_config",
    "load_model",
    "resolve_model_path",
]
