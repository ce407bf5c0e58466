"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with other defaults (no q/k/v bias / with it),
# which ModelConfig carries, so one implementation serves all three.
_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class that implements ``config.architecture``."""
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(_REGISTRY)}") from None
