"""What the HTTP layer needs from an engine, as typing protocols.

The server is written against these protocols rather than the concrete
``engine.async_engine.AsyncEngine`` so that the real engine and the test fake
are interchangeable: ``build_app`` accepts anything with this shape.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, AsyncIterator, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger


class TokenizerLike(Protocol):
    """The tokenizer surface the server uses (``models.tokenizer.Tokenizer``)."""

    eos_token_ids: list[int] | set[int] | frozenset[int] | tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None  # the jinja2 source (None: the model has none)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    # "hermes" or "llama3_json" where the chat template renders tools that way, "unknown" for
    # another syntax, None when it knows nothing of tools.
    tool_call_syntax: str | None
    # A code model's fill-in-the-middle markers (``models.tokenizer.FimTokens``: prefix, suffix,
    # middle, repo, file_sep ids); None when it has none.
    fim_tokens: Any

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None,
                            continue_final_message: bool = False) -> str: ...


class EngineClient(Protocol):
    """The ``AsyncEngine`` interface (see ``engine/async_engine.py``)."""

    tokenizer: TokenizerLike
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids in [0, vocab_size) are valid in a prompt, stop_token_ids, logit_bias
    num_kv_blocks: int
    block_size: int
    lora_adapters: Mapping[str, str]  # served LoRA adapter name -> its directory
    # The model's recommended sampling (generation_config.json) for requests that leave it out,
    # under --override-generation-config's.
    sampling_defaults: Mapping[str, Any]
    # --override-generation-config's sampling alone: llama.cpp's /completion fills what a
    # request leaves out from it, else from llama.cpp's own defaults.
    sampling_overrides: Mapping[str, Any]

    @property
    def is_alive(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def add_stat_logger(self, logger: StatLogger) -> None: ...

    async def start(self) -> None: ...

    def run_loop(self, give_up: threading.Event | None = None) -> None:
        """Run the engine loop on the calling thread until shutdown."""
        ...

    async def shutdown(self) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 group: str | None = None, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Raises ``engine.validation.InvalidRequestError`` at once for a request that can
        never run; the returned stream starts the request when first iterated. Requests
        of one ``group`` take turns with other groups for admission; ``adapter`` is one
        of ``lora_adapters`` (None: the base model)."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at ``path`` as ``name``; ``engine.validation.InvalidRequestError``
        naming ``lora_name`` or ``lora_path`` if it cannot be."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name`` (``ValueError`` if none has that name)."""
        ...

    def abort_all(self) -> None:
        """Abort every unfinished request; each stream ends with an ``abort`` delta."""
        ...
