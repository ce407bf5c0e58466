"""What the HTTP layer needs from an engine, as typing protocols.

The server is written against these protocols rather than the concrete
``engine.async_engine.AsyncEngine`` so that the real engine and the test fake
are interchangeable: ``build_app`` accepts anything with this shape.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger


class TokenizerLike(Protocol):
    """The tokenizer surface the server uses (``models.tokenizer.Tokenizer``)."""

    vocab_size: int
    eos_token_ids: list[int] | set[int] | frozenset[int] | tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True) -> str: ...


class EngineClient(Protocol):
    """The ``AsyncEngine`` interface (see ``engine/async_engine.py``)."""

    tokenizer: TokenizerLike
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int

    @property
    def is_alive(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def add_stat_logger(self, logger: StatLogger) -> None: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...
