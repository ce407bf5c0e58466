"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.gemma import GemmaForCausalLM
from models.gemma4 import Gemma4ForCausalLM
from models.llama import LlamaForCausalLM
from models.moe import MoEForCausalLM

# Mistral, Qwen2, Qwen3 and Phi-3 are Llama with other settings (no q/k/v bias / with
# it / per-head query and key norms / q, k, v and gate, up stored fused, which
# models.fused splits at load), which ModelConfig carries, so one implementation
# serves all five.
_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,  # Llama's modules, Gemma's layer (models/gemma.py)
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,  # Gemma's layer with Gemma 4's options (models/gemma4.py)
    # Mixtures of experts: Llama's attention with experts blocks (models/moe.py)
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
    "GraniteMoeForCausalLM": MoEForCausalLM,
    "GptOssForCausalLM": MoEForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class that implements ``config.architecture``."""
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(_REGISTRY)}") from None
