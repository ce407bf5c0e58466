"""Device work: the KV cache tensors, the flat batch tensors and the forward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.scheduler import SchedulerOutput
from models import kv_cache
from models.attention import AttentionMetadata, SeqSpec, build_attention_metadata
from models.config import ModelConfig
from models.kv_cache import KVLayout
from models.loader import LoadedModel
from models.lora import LoRAAdapter, LoRABatch

logger = logging.getLogger(__name__)


def kv_bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int, tp_size: int = 1,
                       layout: KVLayout | None = None) -> int:
    """Bytes one block id takes, keys and values (on one of ``tp_size`` ranks): every
    layer's that holds a cache, or the ``layout``'s slots' (a hybrid cache's group of layers)."""
    layout = layout if layout is not None else kv_cache.model_layout(config, 0, hybrid=False)
    return kv_cache.block_bytes(layout, kv_cache.model_shapes(config, tp_size), block_size, dtype)


@dataclass
class Chunk:
    """One sequence's tokens in a forward: ``token_ids`` at positions
    ``start_pos..``, their K/V written to ``block_tables`` (one table per group of
    the cache's layout); the logits of the last ``num_sampled`` of them are returned."""

    token_ids: list[int]
    start_pos: int
    block_tables: list[list[int]]
    num_sampled: int
    adapter: str | None = None  # the LoRA adapter its tokens run (None: the base model)
    pooled: bool = False  # its last token's hidden state is wanted (an embedding)


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel model (``engine.workers.WorkerGroup``)."""

    def broadcast_step(self, chunks: list[Chunk]) -> None:
        """Send a forward's chunks to the other ranks, which run it alongside."""

    def forward_failed(self, exc: RuntimeError) -> RuntimeError:
        """The error to raise for a forward that failed in a collective (names a lost rank)."""


class ModelRunner:
    """Owns the model, its device and dtype, and the paged KV cache tensors.

    ``execute`` turns a scheduler decision into one flat forward and returns
    float32 logits for the requests that sample this step.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 peers: StepPeers | None = None, layout: KVLayout | None = None) -> None:
        """``peers``: the other ranks of a tensor-parallel model (each forward is
        sent to them first; they run it alongside). ``layout``: how layers share block
        ids (``models.kv_cache.model_layout``; None: one table for every layer)."""
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.kv_dtype = kv_dtype  # resolved by the engine (``models.kv_cache.resolve_dtype``)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.peers = peers
        # A tensor-parallel rank caches its own KV heads; the block tables are every rank's.
        tp_size = loaded.tp.world_size if loaded.tp is not None else 1
        # Loaded LoRA adapters by the key their requests carry (LLMEngine.install_adapter).
        self.adapters: dict[str, LoRAAdapter] = {}
        self.layout = layout if layout is not None else kv_cache.model_layout(self.config, 0, hybrid=False)
        # Layers of different groups share a slot's memory: their block ids never meet.
        self.kv_caches = kv_cache.allocate(self.layout, kv_cache.model_shapes(self.config, tp_size), num_blocks,
                                           block_size, self.kv_dtype, self.device)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every scheduled token. Returns each entry's ``num_logits`` rows of logits, in
        scheduled order (its wanted prompt positions', for prompt logprobs, then when it
        samples its last known token's and each proposal's), and the float32 hidden
        states of the pooled entries' last tokens in scheduled order (None: none pooled)."""
        return self._forward([Chunk(s.token_ids, s.start_pos, s.block_tables, s.num_logits, s.request.adapter,
                                    s.pool) for s in out.scheduled])

    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """One forward over every chunk; float32 logits of each chunk's last
        ``num_sampled`` tokens, chunk after chunk in the given order."""
        assert not any(c.pooled for c in chunks)
        return self._forward(chunks)[0]

    def _forward(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.peers is None:
            return self._run(chunks)
        try:
            self.peers.broadcast_step(chunks)
            return self._run(chunks)
        except RuntimeError as exc:  # a collective with a lost rank
            raise self.peers.forward_failed(exc) from exc

    def _run(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Decodes (one token) go first: attention batches them in one call. Among each, the
        # requests of a LoRA adapter sit side by side: its rows are then one range (LoRABatch).
        order = sorted(range(len(chunks)), key=lambda i: (len(chunks[i].token_ids) != 1, chunks[i].adapter or ""))
        input_ids: list[int] = []
        positions: list[int] = []
        specs: list[tuple[int, int, list[list[int]]]] = []
        spans: list[tuple[LoRAAdapter | None, int, int]] = []
        last_row: dict[int, int] = {}
        for i in order:
            c = chunks[i]
            end = c.start_pos + len(c.token_ids)
            if c.adapter is not None:
                spans.append((self.adapters[c.adapter], len(input_ids), len(c.token_ids)))
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, end))
            specs.append((len(c.token_ids), end, c.block_tables))
            last_row[i] = len(input_ids) - 1
        sample_rows = [row for i, c in enumerate(chunks)
                       for row in range(last_row[i] + 1 - c.num_sampled, last_row[i] + 1)]
        pooled_rows = [last_row[i] for i, c in enumerate(chunks) if c.pooled]
        dev = self.device
        meta = self._metadata(specs)
        out = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            self.kv_caches,
            torch.tensor(sample_rows, dtype=torch.long, device=dev),
            lora=LoRABatch.of_spans(spans),
            hidden_indices=torch.tensor(pooled_rows, dtype=torch.long, device=dev) if pooled_rows else None,
        )
        logits, hidden = out if pooled_rows else (out, None)
        if dev.type != "cpu":
            logits, hidden = logits.cpu(), hidden.cpu() if hidden is not None else None
        return logits, hidden

    def _metadata(self, specs: list[tuple[int, int, list[list[int]]]]) -> AttentionMetadata:
        """Each group's metadata; layer ``i`` reads its group's (``AttentionMetadata.for_layer``)."""
        metas = []
        for g, window in enumerate(self.layout.group_windows):
            # A windowed table's given-back entries (NULL_BLOCK, -1) are never read: any id does.
            seqs = [SeqSpec(q, ctx, tables[g] if not window else [max(b, 0) for b in tables[g]])
                    for q, ctx, tables in specs]
            metas.append(build_attention_metadata(seqs, self.block_size, self.device))
        if self.layout.hybrid:
            metas[0].by_layer = [metas[g] for g in self.layout.layer_group]
        return metas[0]
