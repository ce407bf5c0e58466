"""Engine settings, one dataclass shared by the CLI, the server and tests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from engine.sampler_settings import BY_NAME, type_error
from engine.sampling_params import SamplingParams

MiB = 1024 * 1024

# The accepted values of ``quantization`` and ``kv_cache_dtype`` (the CLI offers the same).
QUANTIZATIONS = ("auto", "none", "int4", "w4a8", "amx-bf16", "w4a16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


SPECULATIVE_METHODS = ("ngram", "draft")
SCHEDULING_POLICIES = ("fcfs", "priority")
# What --override-generation-config may set: the defaults of requests that leave these
# out (SamplingParams' names; max_new_tokens bounds an answer of no set length).
# What --override-generation-config sets: the sampler settings (engine.sampler_settings),
# llama.cpp's samplers chain and the answer's default length.
_OTHER_KEYS = {"samplers": "strings", "max_new_tokens": "int"}  # (their kinds)
GENERATION_CONFIG_KEYS = (*BY_NAME, *_OTHER_KEYS)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative ngram|draft`` and its settings (vLLM's names where it has them):
    proposals of up to ``num_speculative_tokens``, from the last ``ngram_max`` down to
    ``ngram_min`` tokens (ngram) or from ``draft_model`` run greedily (draft)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    # Speculate only in steps with at most this many decoding requests.
    max_batch: int = 16
    # A request whose last proposals had an acceptance rate below this pauses
    # speculating for a while (``Speculator.PAUSE_STEPS``).
    min_acceptance: float = 0.25
    # draft: a model name, directory or .gguf file with the target's vocabulary.
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model goes with speculative 'draft', and 'draft' needs one "
                             f"(speculative {self.method!r}, draft model {self.draft_model!r})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"speculative min_acceptance must be in [0, 1], got {self.min_acceptance}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (``engine/workers.py``): the model split ``tensor_parallel_size``
    ways, ``tensor_parallel_size / nnodes`` ranks per host. ``node_rank`` 0 is the host of
    rank 0 (the scheduler and the HTTP server) and of the rendezvous at
    ``master_addr:master_port`` (0: a free port, one host only)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size "
                             f"({self.tensor_parallel_size}): each host runs the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("several hosts need a fixed --master-port (and --master-addr, rank 0's host)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was started by ``torchrun``, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def parallel_from_torchrun(parallel: ParallelConfig) -> ParallelConfig:
    """``parallel`` with torchrun's world, address and port, when torchrun started us."""
    found = torchrun_rank()
    if found is None:
        return parallel
    _, world = found
    return ParallelConfig(tensor_parallel_size=world, nnodes=1, node_rank=0,
                          master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          master_port=int(os.environ.get("MASTER_PORT", "29500")))


@dataclass(frozen=True)
class LoRAModule:
    """``--lora-modules NAME=PATH``: a LoRA adapter's served name and its directory."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> "LoRAModule":
        """``NAME=PATH`` (vLLM's syntax); ``ValueError`` for anything else."""
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"a LoRA module is NAME=PATH, got {text!r}")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class StepBudget:
    """What a step and the KV cache may hold, once the device is known: at most
    ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens a step, and
    ``kv_cache_memory`` bytes of KV cache (per tensor-parallel rank)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: int


# NOTE: the CPU's step budget is small on purpose. On a CPU a step's time grows with its
# tokens, and every prompt in a step gets its first token only when the whole step ends,
# so smaller steps let the first prompts of a burst answer sooner. 256 against 512 (the
# 2-core EPYC, 128-token prompts): mean TTFT 0.71x at 4 streams, 0.83x at 16, equal at
# 64, output tok/s and an 1800-token prompt's TTFT unchanged (docs/performance.md, "The
# step's token budget"). At 128, 64 streams' prompts no longer kept up beside 64 decodes
# (mean TTFT 1.4x).
CPU_BUDGET = StepBudget(max_num_seqs=64, max_num_batched_tokens=256, kv_cache_memory=512 * MiB)
# The CPU's KV budget when none is set, sized from the model (``cpu_kv_budget``): room for
# the default batch at CPU_KV_TOKENS_PER_SEQ tokens each, within CPU_KV_MEMORY_FRACTION of
# the memory available once the weights are in, and never under CPU_BUDGET's 512 MiB
# (what every model got before; SmolLM2's 1.5 GiB now). llama-server sizes its cache
# from its context the same way; vLLM-CPU takes a fixed 4 GiB.
CPU_KV_TOKENS_PER_SEQ = 1024
CPU_KV_MEMORY_FRACTION = 0.25
# A GPU's step costs about the same from 1 to thousands of tokens, so it takes vLLM's
# sizes: on an H200, 2048 tokens and 256 sequences against the CPU's 256 and 64 gave
# 1.8x the output tok/s at 64 and 256 streams and a third of the mean TTFT at 64
# (docs/performance.md, "The CUDA path"). The KV cache takes half the memory free once
# the weights are loaded, no more than max_num_seqs sequences of max_model_len need.
CUDA_MAX_NUM_SEQS = 256
CUDA_MAX_NUM_BATCHED_TOKENS = 2048
CUDA_KV_CACHE_FRACTION = 0.5


def cpu_kv_budget(max_num_seqs: int, kv_bytes_per_token: int, available_memory: int | None) -> int:
    """The CPU's default KV cache bytes: ``max_num_seqs`` sequences of
    ``CPU_KV_TOKENS_PER_SEQ`` tokens, at most ``CPU_KV_MEMORY_FRACTION`` of
    ``available_memory`` (bytes; None: not known, no cap), at least 512 MiB
    (less only where that fraction of the memory is less)."""
    want = max(CPU_BUDGET.kv_cache_memory, max_num_seqs * CPU_KV_TOKENS_PER_SEQ * kv_bytes_per_token)
    if available_memory is None:
        return want
    return max(1, min(want, int(CPU_KV_MEMORY_FRACTION * available_memory)))


def step_budget(config: EngineConfig, device_type: str, max_model_len: int, kv_bytes_per_token: int,
                free_memory: int | None = None) -> StepBudget:
    """``config``'s sizes, each one it leaves None from the defaults of ``device_type``
    (``cpu``: :data:`CPU_BUDGET`'s sequences and tokens, the KV cache by ``cpu_kv_budget``
    from ``kv_bytes_per_token`` and the memory available, ``free_memory``; ``cuda``: the
    ``CUDA_*`` settings, the KV cache sized from the device's ``free_memory`` in bytes
    and ``kv_bytes_per_token``)."""
    def own(value: int | None, default: int) -> int:
        return default if value is None else value

    if device_type != "cuda":
        d = CPU_BUDGET
        seqs = own(config.max_num_seqs, d.max_num_seqs)
        kv = config.kv_cache_memory
        if kv is None:
            kv = cpu_kv_budget(seqs, kv_bytes_per_token, free_memory)
        return StepBudget(seqs, own(config.max_num_batched_tokens, d.max_num_batched_tokens), kv)
    seqs = own(config.max_num_seqs, CUDA_MAX_NUM_SEQS)
    tokens = own(config.max_num_batched_tokens, CUDA_MAX_NUM_BATCHED_TOKENS)
    kv = config.kv_cache_memory
    if kv is None:
        if free_memory is None:
            raise ValueError("sizing the KV cache on CUDA needs the device's free memory")
        kv = max(1, min(int(CUDA_KV_CACHE_FRACTION * free_memory), seqs * max_model_len * kv_bytes_per_token))
    return StepBudget(max_num_seqs=seqs, max_num_batched_tokens=tokens, kv_cache_memory=kv)


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    ``model`` is a name (``smollm2``), a checkpoint directory or a ``.gguf``
    file. ``kv_cache_memory`` is the KV cache budget in bytes; the number of
    blocks follows from it and the model's shape. It, ``max_num_seqs`` and
    ``max_num_batched_tokens`` left None take the device's defaults
    (:func:`step_budget`). ``max_model_len=None`` means the model's own context
    length.
    """

    model: str = "smollm2"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    # The step's and the KV cache's sizes: None takes the device's default (StepBudget).
    kv_cache_memory: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Sliding-window layers beside full ones: give back the blocks a window has left
    # (models.kv_cache.KVLayout); False keeps every block for every layer (vLLM's
    # --disable-hybrid-kv-cache-manager).
    hybrid_kv_cache: bool = True
    # A mixture of experts: count the tokens each layer routes to each expert (the
    # kvserve_moe_routed_tokens metric); off by default (--expert-routing-metrics).
    expert_routing_metrics: bool = False
    served_model_name: str | None = None
    # QUANTIZATIONS (CPU): int4 = int4 weights with float activations for small
    # decode batches; w4a8 = int4 weights and int8 activations (per 16 inputs),
    # integer dots (AVX512-VNNI, else AVX-512 BW's or AVX2's), every batch.
    # amx-bf16 = bfloat16 weights on AMX-BF16 tiles, float32 activations rounded to
    # bfloat16 at each projection (CPUs with AMX-BF16; chosen only when asked for).
    # w4a16 = the same tile arithmetic on 4-bit weights made bfloat16 in the kernel
    # (CPUs with AMX-BF16).
    # auto (with dtype auto) = the fastest path measured on this CPU
    # (models/autotune.py): w4a8, int4 or none for a GGUF with 4-bit
    # projections, none otherwise.
    quantization: str = "auto"
    # KV_CACHE_DTYPES. auto: float16 for a float32 model
    # (as llama.cpp's default f16 cache: twice the tokens, half the bytes decode
    # attention reads, logits within about 0.02), else the model's dtype.
    kv_cache_dtype: str = "auto"
    # A Jinja2 chat template file used instead of the model's own (--chat-template).
    chat_template: str | None = None
    # Speculative decoding (engine/speculative.py, --speculative): None is off.
    speculative: SpeculativeConfig | None = None
    # Tensor parallelism (--tensor-parallel-size): one rank by default.
    parallel: ParallelConfig = ParallelConfig()
    # LoRA adapters served beside the base model (--lora-modules), each under its name.
    lora_modules: tuple[LoRAModule, ...] = ()
    # vLLM's --max-loras: at most this many adapters have requests running at once
    # (None: any number); --max-lora-rank: adapters of a larger rank are refused.
    max_loras: int | None = None
    max_lora_rank: int | None = None
    # vLLM's --generation-config: "auto" takes the default sampling of requests that leave
    # it out from the model's generation_config.json; "vllm" ignores that file's.
    generation_config: str = "auto"
    # vLLM's --override-generation-config: default sampling (GENERATION_CONFIG_KEYS) for
    # requests that leave it out, over the model's generation_config.json values.
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's --scheduling-policy: "fcfs" (every request's priority is 0) or "priority"
    # (requests' own priorities order admission and preemption: engine/scheduler.py).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be {_one_of(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be {_one_of(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be {_one_of(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be auto or vllm, got {self.generation_config!r}")
        self._check_override_generation_config()
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter names must differ, got {', '.join(names)}")
        if self.served_model_name is not None and self.served_model_name in names:
            raise ValueError(f"a LoRA adapter cannot take the served model's name {self.served_model_name!r}")

    def _check_override_generation_config(self) -> None:
        override = self.override_generation_config
        unknown = sorted(set(override) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config cannot set {', '.join(unknown)}; it sets "
                             f"{', '.join(GENERATION_CONFIG_KEYS)}")
        for key, value in override.items():
            kind = type_error(BY_NAME[key].kind if key in BY_NAME else _OTHER_KEYS[key], value)
            if kind is not None:
                raise ValueError(f"override_generation_config's {key} must be {kind}, got {value!r}")
        if override.get("max_new_tokens", 1) < 1:
            raise ValueError(f"override_generation_config's max_new_tokens must be >= 1, "
                             f"got {override['max_new_tokens']}")
        try:
            SamplingParams(**{k: v for k, v in override.items() if k != "max_new_tokens"})
        except ValueError as e:
            raise ValueError(f"override_generation_config: {e}") from None

