"""Tensor-parallel plumbing without processes: the step's wire format, the settings, torchrun's env."""

from __future__ import annotations

import pytest

from engine.config import ParallelConfig, parallel_from_torchrun, torchrun_rank
from engine.model_runner import Chunk
from engine.workers import RankSpec, _decode, _encode


def test_a_step_survives_the_wire():
    # Each chunk's LoRA adapter travels as its place in the spec's list.
    adapters = ["sql", "poet"]
    chunks = [Chunk([5], 40, [[2, 9, 4]], 1, "poet"), Chunk(list(range(100, 117)), 16, [[7, 8]], 0),
              Chunk([1, 2, 3], 0, [[1]], 3, "sql"), Chunk([], 0, [[]], 0)]
    flat = _encode(chunks, adapters)
    assert flat.dtype.is_floating_point is False
    assert _decode(len(chunks), flat.tolist(), adapters, 1) == chunks
    # A hybrid cache's tables, one per group (a windowed group's given-back entries are -1).
    grouped = [Chunk([5], 40, [[2, 9, 4], [-1, 3, 6]], 1), Chunk([7, 8], 0, [[1], [5]], 2, "sql")]
    assert _decode(len(grouped), _encode(grouped, adapters).tolist(), adapters, 2) == grouped


def test_parallel_settings_are_checked():
    assert ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=29500).ranks_per_node == 2
    with pytest.raises(ValueError, match="nnodes \\(3\\) must divide tensor_parallel_size \\(4\\)"):
        ParallelConfig(tensor_parallel_size=4, nnodes=3)
    with pytest.raises(ValueError, match="node_rank must be in \\[0, 1\\]"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500)
    with pytest.raises(ValueError, match="several hosts need a fixed --master-port"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(tensor_parallel_size=0)


def test_torchrun_environment_is_read(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_rank() is None
    assert parallel_from_torchrun(ParallelConfig()) == ParallelConfig()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert torchrun_rank() == (1, 3)
    assert parallel_from_torchrun(ParallelConfig()) == ParallelConfig(3, 1, 0, "10.0.0.5", 29400)


def test_a_rank_spec_round_trips_as_json():
    spec = RankSpec(model="smollm2", dtype="float32", quantization="w4a8", device="cpu", max_positions=None,
                    kv_cache_dtype="float16", block_size=16, world_size=3, ranks_per_node=3,
                    master_addr="127.0.0.1", master_port=1234)
    assert RankSpec.from_json(spec.to_json()) == spec
