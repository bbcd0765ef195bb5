"""docker/: the compose file, its configs, Prometheus targets and the Grafana dashboard agree with each other
and with the metrics kvgate really exports; the images can write the shared model, build from a small
context and run the engine without Triton on CPU."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_config
from tests.harness import MODEL, ClusterFactory

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


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


def _compose_duration_s(text: str) -> float:
    """A compose duration (``1m30s``, ``40s``, ``500ms``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


@pytest.mark.parametrize("region", ["eu-west", "us-east"])
def test_docker_stop_lets_each_gateway_drain_and_flush_its_ledger(region: str) -> None:
    """``docker compose stop``/``down`` sends SIGTERM, then SIGKILL after the service's stop_grace_period
    (10 s when unset). A gateway lets its streams finish for drain_timeout_s (30 s) and then flushes its
    ledger: with the default grace, streams longer than 10 s were cut by the SIGKILL and the flush never
    ran."""
    config = load_config(DOCKER / "config" / f"{region}.toml", environ={})
    service = compose()["services"][f"{region}-gateway"]
    grace = _compose_duration_s(str(service.get("stop_grace_period", "10s")))
    assert grace >= config.gateway.resilience.drain_timeout_s + 5, (grace, region)


@pytest.mark.parametrize("region", ["eu-west", "us-east"])
def test_compose_stops_each_gateway_before_the_engines_and_redis_it_uses(region: str) -> None:
    """Compose stops a service before the services it depends on, and the others all at once: the engines
    stopped beside a draining gateway, cutting the streams its drain was for, and its ledger's Redis could
    go before its last write."""
    config = load_config(DOCKER / "config" / f"{region}.toml", environ={})
    depends_on = set(compose()["services"][f"{region}-gateway"]["depends_on"])
    engines = {str(e.url).split("//")[1].split(":")[0] for r in config.topology.regions for e in r.engines}
    assert engines and engines | {"redis"} <= depends_on, (region, engines - depends_on)


def test_every_kvgate_process_runs_under_an_init() -> None:
    """As PID 1 a process gets no default signal actions and must reap every orphan: the engine's core
    process and the workers' processes and private Redis are children of kvgate."""
    services = compose()["services"]
    kvgate = [n for n, s in services.items() if str(s.get("image", "")).startswith("kvgate")]
    assert len(kvgate) >= 7 and all(services[n].get("init") is True for n in kvgate), kvgate


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


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """A Dockerfile's (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, rest = pending.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
        pending = ""
    return result


DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def test_compose_builds_from_these_dockerfiles() -> None:
    built = {s["build"]["dockerfile"] for s in compose()["services"].values() if "build" in s}
    assert built == {f"docker/{d.name}" for d in DOCKERFILES}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_owns_models_before_dropping_root(dockerfile: Path) -> None:
    """An empty named volume takes the owner of the image's directory it is mounted on: without a /models
    owned by kvgate, the volume's root is root's and the `model` service (kvgate) cannot write the model."""
    steps = instructions(dockerfile)
    users = [i for i, (k, _) in enumerate(steps) if k == "USER"]
    assert [steps[i][1] for i in users] == ["kvgate"]
    before = " && ".join(args for k, args in steps[: users[0]] if k == "RUN")
    assert re.search(r"mkdir -p /models\b", before), "the image has no /models"
    assert re.search(r"chown (-R )?kvgate(:kvgate)? /models\b", before), "/models is not kvgate's"


def test_every_service_writing_the_model_volume_runs_an_image_that_owns_it() -> None:
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            if source == "models" and mode != ["ro"]:
                assert target == "/models", name
                dockerfile = ROOT / service["build"]["dockerfile"]
                run = " ".join(a for k, a in instructions(dockerfile) if k == "RUN")
                assert "chown kvgate:kvgate /models" in run, name
                assert service.get("user") in (None, "kvgate"), name


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker (moby/patternmatcher) reads it: Go's filepath.Match plus `**`."""
    pattern = pattern.strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "$")


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (relative to the repository root) out of the build context: the
    last pattern matching it or one of its parent directories decides, `!` patterns re-include."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    rules = [(p.startswith("!"), _dockerignore_regex(p.lstrip("!"))) for p in patterns]
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negated, regex in rules:
        if any(regex.match(p) for p in prefixes):
            excluded = not negated
    return excluded


@pytest.mark.parametrize(
    "path",
    [
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".venv-vllm/bin/python",
        ".git/HEAD",
        "build/lib/gateway/__init__.py",
        "dist/kvgate-0.1.0.tar.gz",
        "kvgate.egg-info/PKG-INFO",
        "test-artifacts/report.xml",
        ".pytest_cache/v/cache/nodeids",
        ".mypy_cache/3.11/gateway/config.data.json",
        ".ruff_cache/CACHEDIR.TAG",
        ".hypothesis/examples/0",
        "gateway/__pycache__/config.cpython-311.pyc",
        "engine/compress/_rans.cpython-311-x86_64-linux-gnu.so",
        "ledger.spool",
        "gateway/ledger.spool",
    ],
)
def test_dockerignore_keeps_environments_caches_and_outputs_out(path: str) -> None:
    assert dockerignored(path)


def test_dockerignore_keeps_everything_the_dockerfiles_copy() -> None:
    sources: set[str] = set()
    for dockerfile in DOCKERFILES:
        for keyword, args in instructions(dockerfile):
            if keyword in ("COPY", "ADD"):
                words = [w for w in args.split() if not w.startswith("--")]
                sources |= set(words[:-1])
    assert {"pyproject.toml", "README.md", "cache", "engine", "gateway", "region_map"} <= sources
    for source in sorted(sources):
        path = ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        tracked = subprocess.run(
            ["git", "ls-files", "--", source], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        assert files and tracked, source
        for file in tracked:  # every tracked file the image needs reaches the build context
            assert not dockerignored(file), file


def _engine_requirements_command() -> str:
    run = [a for k, a in instructions(DOCKER / "engine.Dockerfile") if k == "RUN" and "tomllib" in a]
    assert len(run) == 1, "the engine image reads the engine extra's requirements from pyproject.toml"
    match = re.match(r'python -c "([^"]+)" > (\S+)', run[0])
    assert match, run[0]
    assert f"pip install . -r {match.group(2)}" in run[0]
    return match.group(1)


def test_the_engine_image_installs_torch_for_cpu_and_no_triton() -> None:
    steps = instructions(DOCKER / "engine.Dockerfile")
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG")
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VERSION"] == "2.13.0"  # the version scripts/test pins
    runs = [a for k, a in steps if k == "RUN"]
    assert any('--index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"' in a for a in runs)
    for run in runs:  # never the `engine` extra itself (it asks for triton on Linux), never triton by name
        assert "[engine]" not in run and not re.search(r"pip install[^&]*\btriton", run), run
    # The requirements the image installs with the package: the engine extra's, less triton.
    result = subprocess.run(
        [sys.executable, "-c", _engine_requirements_command()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    requirements = result.stdout.split("\n")
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements if r}
    assert "triton" not in names and {"torch", "safetensors"} <= names
    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["engine"]
    assert [r for r in requirements if r] == [r for r in extra if not r.startswith("triton")]


def test_the_engine_runs_on_cpu_without_triton(tmp_path: Path) -> None:
    """As in the CPU engine image: `import triton` fails, the kernels fall back to eager torch."""
    script = """
import sys
sys.modules["triton"] = None  # as if it were not installed
import torch
from engine.kernels import ops
from engine.kernels.triton_support import HAVE_TRITON
assert not HAVE_TRITON
x = torch.randn(3, 8)
out, residual = ops.rms_norm(x, torch.ones(8), 1e-6)
assert out.shape == x.shape and torch.isfinite(out).all()
assert ops.silu_and_mul(x, x).shape == x.shape
print("eager ok")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "eager ok" in result.stdout, result.stderr


@pytest.mark.parametrize("dockerfile", ["engine.Dockerfile", "gateway.Dockerfile"])
def test_each_image_copies_every_package_the_project_ships(dockerfile: str) -> None:
    """A package missing from an image fails at import inside the container only (perfmodel once was)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copies = set(re.findall(r"^COPY (\S+) \./\1$", (DOCKER / dockerfile).read_text(), re.MULTILINE))
    assert set(packages) <= copies, sorted(set(packages) - copies)
