"""Engine settings, one dataclass shared by the CLI, the server and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.speculative import SpeculativeConfig

MiB = 1024 * 1024

# The accepted values of ``quantization`` and ``kv_cache_dtype`` (the CLI offers the same).
QUANTIZATIONS = ("auto", "none", "int4", "w4a8")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    ``model`` is a name (``smollm2``), a checkpoint directory or a ``.gguf``
    file. ``kv_cache_memory`` is the KV cache budget in bytes; the number of
    blocks follows from it and the model's shape. ``max_model_len=None`` means
    the model's own context length.
    """

    model: str = "smollm2"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    kv_cache_memory: int = 512 * MiB
    block_size: int = 16
    max_num_seqs: int = 64
    # NOTE: small on purpose: on a CPU a 2048-token prefill step takes seconds, stalling
    # every running stream and the first token of all requests admitted with it.
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    served_model_name: str | None = None
    # QUANTIZATIONS (CPU): int4 = int4 weights with float activations for small
    # decode batches; w4a8 = int4 weights and int8 activations (per 16 inputs) on
    # AVX512-VNNI, every batch. auto (with dtype auto) = the fastest path measured
    # on this CPU (models/autotune.py): w4a8, int4 or none for a GGUF with 4-bit
    # projections, none otherwise.
    quantization: str = "auto"
    # KV_CACHE_DTYPES. auto: float16 for a float32 model
    # (as llama.cpp's default f16 cache: twice the tokens, half the bytes decode
    # attention reads, logits within about 0.02), else the model's dtype.
    kv_cache_dtype: str = "auto"
    # A Jinja2 chat template file used instead of the model's own (--chat-template).
    chat_template: str | None = None
    # Speculative decoding (engine/speculative.py): None (off) or "ngram" (prompt
    # lookup); proposals of up to num_speculative_tokens from the last
    # ngram_max..ngram_min tokens; only in steps with at most
    # speculative_max_batch decodes, and paused for a request whose acceptance
    # rate falls below speculative_min_acceptance.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    speculative_max_batch: int = 16
    speculative_min_acceptance: float = 0.25

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be {_one_of(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be {_one_of(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.speculative is not None:
            self.speculative_config()  # raises ValueError for a bad setting, before any loading
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def speculative_config(self) -> SpeculativeConfig:
        """The speculative decoding settings (``speculative`` must be set)."""
        from engine.speculative import SpeculativeConfig

        assert self.speculative is not None
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.ngram_min, self.ngram_max,
                                 self.speculative_max_batch, self.speculative_min_acceptance)
