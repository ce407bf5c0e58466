"""bench.spec's pieces that need no server: the methods, the counters' parsing, the table."""

from __future__ import annotations

import httpx
import pytest

from bench import spec


def test_methods_add_the_draft_only_when_named() -> None:
    assert [name for name, _ in spec.methods(None)] == ["none", "ngram"]
    name, flags = spec.methods("qwen2.5-coder-0.5b")[-1]
    assert name == "draft qwen2.5-coder-0.5b" and flags[-2:] == ["--draft-model", "qwen2.5-coder-0.5b"]


def test_counters_read_the_totals_and_not_the_per_position_series(monkeypatch: pytest.MonkeyPatch) -> None:
    text = ('kvserve_spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            'kvserve_spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
            'kvserve_spec_decode_num_accepted_tokens_per_pos{model_name="m",position="0"} 9.0\n'
            'kvserve_spec_decode_num_accepted_tokens_total{model_name="m"} 25.0\n')
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(200, text=text))
    assert spec.counters("http://127.0.0.1:1") == {"spec_decode_num_drafts": 10.0,
                                                   "spec_decode_num_draft_tokens": 40.0,
                                                   "spec_decode_num_accepted_tokens": 25.0}


def test_the_table_gives_each_method_against_no_speculation() -> None:
    row = {"load": "quote", "concurrency": 1, "tpot_ms": 50.0, "ttft_ms": 300.0, "completed": 8}
    report = {"methods": {"none": [{**row, "output_tok_s": 10.0, "acceptance": None, "accepted_per_step": None}],
                          "ngram": [{**row, "output_tok_s": 15.0, "acceptance": 0.625, "accepted_per_step": 2.5}]}}
    table = spec.format_report(report)
    assert "| ngram | quote | 1 | 15.0 | 1.50x | 50.0 | 300 | 62% | 2.50 |" in table
    assert "| none | quote | 1 | 10.0 | 1.00x |" in table
