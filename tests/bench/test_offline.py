"""``python -m bench.offline``: the engine's own throughput, on the path its flags name."""

from __future__ import annotations

import json

from bench import offline


def test_the_flags_reach_the_engine_and_every_token_is_counted(tmp_path) -> None:
    out = tmp_path / "offline.json"
    offline.main(["--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--max-num-seqs", "2",
                  "--kv-cache-memory", "128", "--quantization", "w4a8", "--kv-cache-dtype", "int8",
                  "--skip-transformers", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["args"]["quantization"] == "w4a8"
    (row,) = report["results"]
    assert row["kv_cache_dtype"] == "int8"
    assert row["output_tokens"] == 3 * 2
