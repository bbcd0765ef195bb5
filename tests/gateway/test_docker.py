"""docker/: the compose file, its configs, Prometheus targets and the Grafana dashboard agree with each other
and with the metrics kvgate really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_config
from tests.harness import MODEL, ClusterFactory

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DOCKER / "compose.yaml").read_text()))


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="no `docker compose` on this machine")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker", "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_the_compose_file_is_complete() -> None:
    services = compose()["services"]
    regions = ("eu-west", "us-east")
    expected = {"redis", "model", "prometheus", "grafana"} | {
        f"{r}-{part}" for r in regions for part in ("gateway", "prefill", "decode")
    }
    assert set(services) == expected
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DOCKER / source).exists(), f"{name}: {source}"
    for region in regions:
        for role in ("prefill", "decode"):
            command = services[f"{region}-{role}"]["command"]
            assert command[0] == "engine" and command[command.index("--role") + 1] == role
            assert command[command.index("--engine-id") + 1] == f"{region}/{role}"


@pytest.mark.parametrize("region", ["eu-west", "us-east"])
def test_each_gateway_config_loads_and_names_compose_services(region: str) -> None:
    config = load_config(DOCKER / "config" / f"{region}.toml", environ={})
    assert config.topology.region == region
    services = compose()["services"]
    for r in config.topology.regions:
        roles = sorted(e.role.value for e in r.engines)
        assert roles == ["decode", "prefill"]
        for engine in r.engines:
            host = re.match(r"http://([^:/]+):8000", str(engine.url))
            assert host and host.group(1) in services
    assert config.gateway.tokenizer == "/models/model"


def test_prometheus_scrapes_every_gateway_and_engine() -> None:
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]
    }
    services = compose()["services"]
    expected = {f"{name}:{8080 if name.endswith('gateway') else 8000}" for name in services if "-" in name}
    assert targets == expected


async def test_the_grafana_dashboard_only_uses_metrics_kvgate_exports(make_cluster: ClusterFactory) -> None:
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "kvgate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|total)$", "", m) for e in exprs for m in re.findall(r"kvgate_[a-z_]+", e)}
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    messages = [{"role": "user", "content": "the same long question, twice " * 8}]
    for _ in range(2):  # a stream, then one that hits the cache: every labelled series has a value
        body = {"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True}
        async with cluster.session.post(cluster.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and (await r.read()).endswith(b"[DONE]\n\n")
    exported: set[str] = set()
    engine_url = next(iter(cluster.engines.values()))[1]
    for url in (cluster.url + "/metrics", engine_url + "/metrics"):
        async with cluster.session.get(url) as r:
            text = await r.text()
        exported |= {
            re.sub(r"_(bucket|total|count|sum|created)$", "", m)
            for m in re.findall(r"^(kvgate_[a-z_]+)", text, re.M)
        }
    assert used and used <= exported, used - exported
