"""``kvserve serve --replicas``: what each replica runs, and the replicas' metrics in one exposition."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.cli.serve import replica_argv


def test_each_replica_gets_every_option_but_the_applications():
    argv = ["serve", "--replicas", "2", "--model", "smollm2", "--port=9000", "--host", "0.0.0.0",
            "--max-replicas", "4", "--dtype", "float32", "--target-ongoing-requests=8", "--api-key", "k"]
    assert replica_argv(argv) == ["--model", "smollm2", "--dtype", "float32", "--api-key", "k"]


def test_replica_metrics_merge_into_one_family_each_labelled_by_replica():
    ray_app = pytest.importorskip("server.ray_app", reason="Ray Serve is the [ray] extra")
    one = ('# HELP kvserve_prompt_tokens_total Prompt tokens processed.\n# TYPE kvserve_prompt_tokens_total counter\n'
           'kvserve_prompt_tokens_total{model_name="m"} 5.0\n'
           '# HELP kvserve_kv_cache_blocks_used KV cache blocks in use.\n# TYPE kvserve_kv_cache_blocks_used gauge\n'
           'kvserve_kv_cache_blocks_used{model_name="m"} 3.0\n')
    two = one.replace("5.0", "7.0").replace("3.0", "0.0")
    text = ray_app.merge_metrics([("a", one), ("b", two)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE kvserve_prompt_tokens_total counter") == 1
    samples = {(s.name, s.labels["replica"]): s.value for f in families.values() for s in f.samples}
    assert samples == {("kvserve_prompt_tokens_total", "a"): 5.0, ("kvserve_prompt_tokens_total", "b"): 7.0,
                       ("kvserve_kv_cache_blocks_used", "a"): 3.0, ("kvserve_kv_cache_blocks_used", "b"): 0.0}


def test_runtime_lora_loading_is_refused_with_replicas():
    # A load through Ray's proxy would reach one replica: refused before anything starts.
    from server import cli

    with pytest.raises(SystemExit, match="--allow-runtime-lora does not go with --replicas"):
        cli.main(["serve", "--replicas", "2", "--allow-runtime-lora"])
