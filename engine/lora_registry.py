"""The LoRA adapters an engine serves, and when their weights may go.

An adapter has a served name (what a request asks for, what /v1/models lists)
and a key (what ``Request.adapter`` carries and the model runner's weights are
keyed by). The key is the name for the adapters of the start-up (what the
tensor-parallel ranks know them by), ``name@N`` for the N-th loaded while
serving: requests of an adapter unloaded and loaded again never share the old
one's weights or cached blocks. An unloaded adapter's weights stay until the
last request that runs them leaves the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from engine.request import Request
from engine.validation import InvalidRequestError
from models.loader import LoadedModel
from models.lora import LoRAAdapter, load_adapter

logger = logging.getLogger(__name__)


class LoRARegistry:
    """Served adapter names -> keys and directories; the weights themselves are
    ``weights`` (the model runner's, by key), which this keeps in step.

    ``install``/``remove``/``acquire``/``release`` run on the engine thread;
    ``read`` and ``lookup`` read only what the engine thread replaces whole, so
    any thread may call them.
    """

    def __init__(self, loaded: LoadedModel, served_model_name: str, max_lora_rank: int | None,
                 weights: dict[str, LoRAAdapter]) -> None:
        self._loaded = loaded
        self._model_name = served_model_name
        self._max_rank = max_lora_rank
        self.weights = weights
        # Served name -> its directory (the engine's ``lora_adapters``: callers keep this
        # dict and see it change, so it is only ever changed in place).
        self.paths: dict[str, str] = {}
        self._keys: dict[str, str] = {}  # served name -> key
        self._retired: set[str] = set()  # keys unloaded while requests still run them
        self._users: dict[str, int] = {}  # key -> requests in the engine that run it
        self._loads = 0

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter's weights for the model (``models.lora.load_adapter``:
        ``ValueError`` naming what is wrong, a rank above ``max_lora_rank`` too)."""
        loaded = self._loaded
        if not loaded.model.runs_lora:
            raise ValueError(f"LoRA adapter {name!r}: {loaded.config.architecture} runs no LoRA adapters yet")
        adapter = load_adapter(name, path, loaded.config, loaded.dtype, loaded.device, tp=loaded.tp)
        if self._max_rank is not None and adapter.rank > self._max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}, above --max-lora-rank {self._max_rank}")
        return adapter

    def install(self, adapter: LoRAAdapter, path: str, key: str | None = None) -> None:
        """Serve ``adapter`` under its name from the next request on, keyed by ``key``
        (default: a fresh ``name@N``). ``ValueError`` if the name is taken."""
        if adapter.name == self._model_name:
            raise ValueError(f"a LoRA adapter cannot take the served model's name {self._model_name!r}")
        if adapter.name in self.paths:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if key is None:
            self._loads += 1
            key = f"{adapter.name}@{self._loads}"
        self.weights[key] = adapter
        self._keys[adapter.name] = key
        self.paths[adapter.name] = path
        logger.info("LoRA adapter %r loaded from %s (rank %d)", adapter.name, path, adapter.rank)

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests for it are refused; its weights go
        now, or with the last request that runs them. ``ValueError`` if no adapter has that name."""
        key = self._keys.pop(name, None)
        if key is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.paths[name]
        if key in self._users:
            self._retired.add(key)
        else:
            del self.weights[key]
        logger.info("LoRA adapter %r unloaded", name)

    def lookup(self, name: str) -> tuple[str, LoRAAdapter]:
        """The key and weights a request for adapter ``name`` runs;
        ``InvalidRequestError`` if none is loaded by that name."""
        key = self._keys.get(name)
        lora = self.weights.get(key) if key is not None else None
        if key is None or lora is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "adapter")
        return key, lora

    def acquire(self, key: str, lora: LoRAAdapter) -> None:
        """A request that runs ``key`` enters the engine. ``lora``: the weights it looked
        up, served again if the adapter was unloaded since (then they go with it)."""
        if key not in self.weights:
            self.weights[key] = lora
            self._retired.add(key)
        self._users[key] = self._users.get(key, 0) + 1

    def release(self, key: str) -> None:
        """A request that ran ``key`` left the engine (finished or aborted)."""
        users = self._users[key] - 1
        if users:
            self._users[key] = users
            return
        del self._users[key]
        if key in self._retired:
            self._retired.discard(key)
            del self.weights[key]

    def count_by_name(self, requests: Iterable[Request]) -> dict[str, int]:
        """How many of ``requests`` run each adapter, by served name: every served
        adapter from 0 (metrics drop an unloaded adapter's series), plus the unloaded
        ones that still run."""
        counts = dict.fromkeys(self.paths, 0)
        for request in requests:
            if request.adapter is not None:
                name = self.weights[request.adapter].name
                counts[name] = counts.get(name, 0) + 1
        return counts
