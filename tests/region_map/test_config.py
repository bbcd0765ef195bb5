"""The deployment file: valid files load, and every error names the key at fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_config, parse_config
from region_map.config import ConfigError, Role

GOOD = """
region = "eu-west"
default_rtt_ms = 70

[[regions]]
name = "eu-west"
engines = [
  { name = "e0", url = "http://127.0.0.1:8001", role = "prefill", kv_capacity_blocks = 4096 },
  { name = "e1", url = "http://127.0.0.1:8002" },
]

[[regions]]
name = "us-east"
engines = [{ name = "e0", url = "http://10.1.0.5:8000", model = "llama" }]

[rtt_ms]
"eu-west.us-east" = 80

[gateway]
port = 9000
block_size = 32

[gateway.routing]
policy = "cache_aware"
max_waiting = 4
"""


def test_a_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(GOOD)
    config = load_config(path)
    topo = config.topology
    assert topo.region == "eu-west"
    assert [r.name for r in topo.regions] == ["eu-west", "us-east"]
    assert topo.regions[0].engines[0].role is Role.PREFILL
    assert topo.regions[0].engines[1].role is Role.BOTH
    assert topo.rtt_s("us-east", "eu-west") == pytest.approx(0.080)
    assert topo.rtt_s("eu-west", "eu-west") == 0.0
    assert config.gateway.port == 9000 and config.gateway.block_size == 32
    assert config.gateway.routing.policy == "cache_aware" and config.gateway.routing.max_waiting == 4


def test_yaml_works_too(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "region: a\nregions:\n  - name: a\n    engines:\n      - {name: e0, url: 'http://127.0.0.1:9'}\n"
    )
    assert load_config(path).topology.regions[0].engines[0].base_url == "http://127.0.0.1:9"


def _base() -> dict:
    return {
        "region": "a",
        "regions": [{"name": "a", "engines": [{"name": "e0", "url": "http://127.0.0.1:9"}]}],
    }


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        (lambda d: d["regions"][0]["engines"][0].update(url="not a url"), "regions.0.engines.0.url"),
        (lambda d: d["regions"][0]["engines"][0].update(role="both-ish"), "regions.0.engines.0.role"),
        (
            lambda d: d["regions"][0]["engines"][0].update(kv_capacity_blocks=-1),
            "regions.0.engines.0.kv_capacity_blocks",
        ),
        (lambda d: d["regions"][0]["engines"][0].update(urll="x"), "regions.0.engines.0.urll"),
        (lambda d: d.update(region="nowhere"), "nowhere"),
        (lambda d: d.update(rtt_ms={"a.b": 5}), "a.b"),
        (lambda d: d.update(gateway={"port": "eighty"}), "gateway.port"),
        (lambda d: d.update(gateway={"routing": {"max_waiting": 0}}), "gateway.routing.max_waiting"),
        # (a TTL Redis cannot take in milliseconds: every binding's write refused)
        (lambda d: d.update(gateway={"response_ttl_s": 1e20}), "gateway.response_ttl_s"),
        (lambda d: d.update(gateway={"session_ttl_s": 1e20}), "gateway.session_ttl_s"),
        (lambda d: d.update(gateway={"approx_ttl_s": 1e20}), "gateway.approx_ttl_s"),
        (lambda d: d.update(gateway={"pending_ttl_s": 1e20}), "gateway.pending_ttl_s"),
        (lambda d: d.update(gatewy={}), "gatewy"),
        (lambda d: d["regions"][0]["engines"].append({"name": "e0", "url": "http://x:1"}), "e0"),
        (lambda d: d["regions"][0]["engines"][0].update(kind="tgi"), "regions.0.engines.0.kind"),
        (
            lambda d: d["regions"][0]["engines"][0].update(kind="vllm", kv_events_endpoint="http://h:5557"),
            "regions.0.engines.0.kv_events_endpoint",
        ),
        (
            lambda d: d["regions"][0]["engines"][0].update(kind="vllm", kv_events_endpoint="tcp://h"),
            "needs a port",
        ),
        (
            lambda d: d["regions"][0]["engines"][0].update(kv_events_endpoint="tcp://h:5557"),
            "kv_events_endpoint is for kind vllm or sglang",
        ),
        (
            lambda d: d["regions"][0]["engines"][0].update(kind="openai", kv_events=True),
            "kind openai publishes no KV events",
        ),
        (
            lambda d: d["regions"][0]["engines"].extend(
                [
                    {"name": n, "url": "http://h:1", "kind": "vllm", "kv_events_endpoint": "tcp://*:5557"}
                    for n in ("v1", "v2")
                ]
            ),
            "a/v1 and a/v2 have the same kv_events_endpoint",
        ),
        (
            lambda d: d["regions"][0]["engines"][0].update(
                kind="vllm", kv_events_endpoint="ipc:///run/vllm-events", data_parallel_size=2
            ),
            "data_parallel_size > 1 needs tcp://",
        ),
        (
            lambda d: d["regions"][0]["engines"][0].update(kind="vllm", data_parallel_size=0),
            "regions.0.engines.0.data_parallel_size",
        ),
        (  # one engine listed twice (a copy-paste): its one cache counted as two engines
            lambda d: d["regions"][0]["engines"].append({"name": "e1", "url": "http://127.0.0.1:9/"}),
            "engines a/e0 and a/e1 have the same url http://127.0.0.1:9",
        ),
        (  # (in another region too)
            lambda d: d["regions"].append(
                {"name": "b", "engines": [{"name": "e0", "url": "http://127.0.0.1:9", "kind": "vllm"}]}
            ),
            "engines a/e0 and b/e0 have the same url",
        ),
    ],
)
def test_errors_name_the_bad_key(patch, key: str) -> None:  # type: ignore[no-untyped-def]
    data = _base()
    patch(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert key in str(info.value)


def test_one_server_may_be_listed_once_per_model() -> None:
    """A server of several models behind one URL (an OpenAI-compatible upstream, vLLM's LoRA adapters) is
    listed once per model: those may share a URL, two listings of one model may not."""
    data = _base()
    data["regions"][0]["engines"] = [
        {"name": f"m{i}", "url": "http://10.0.0.9:8000", "kind": "openai", "model": model}
        for i, model in enumerate(("llama", "qwen"))
    ]
    assert len(parse_config(data).topology.regions[0].engines) == 2
    data["regions"][0]["engines"][1]["model"] = "llama"
    with pytest.raises(ConfigError, match="a/m0 and a/m1 have the same url"):
        parse_config(data)


def test_engine_kinds_and_their_event_endpoints_load() -> None:
    data = _base()
    data["regions"][0]["engines"] = [
        {"name": "v", "url": "http://127.0.0.1:8000", "kind": "vllm",
         "kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5558"},
        {"name": "s", "url": "http://127.0.0.1:30000", "kind": "sglang", "role": "prefill",
         "bootstrap_port": 9001},
        {"name": "o", "url": "http://127.0.0.1:9000", "kind": "openai"},
    ]  # fmt: skip
    engines = parse_config(data).topology.regions[0].engines
    assert [e.kind for e in engines] == ["vllm", "sglang", "openai"]
    assert engines[0].kv_events_endpoint == "tcp://127.0.0.1:5557" and engines[0].data_parallel_size == 1
    assert engines[1].bootstrap_port == 9001 and engines[1].role is Role.PREFILL
    assert engines[2].kv_events is None and engines[2].accepts_token_ids is None


def test_the_kv_event_message_size_limit_defaults_to_64_mib_and_is_at_least_1_mib() -> None:
    assert parse_config(_base()).gateway.kv_event_max_message_bytes == 64 << 20
    data = _base() | {"gateway": {"kv_event_max_message_bytes": 1 << 20}}
    assert parse_config(data).gateway.kv_event_max_message_bytes == 1 << 20
    for bad in ((1 << 20) - 1, 0, "64MiB"):
        data = _base() | {"gateway": {"kv_event_max_message_bytes": bad}}
        with pytest.raises(ConfigError, match=r"^gateway\.kv_event_max_message_bytes: "):
            parse_config(data)


def test_environment_and_flags_override_the_file() -> None:
    data = _base() | {"gateway": {"port": 1000, "redis_url": "redis://file"}}
    config = parse_config(data, environ={"KVGATE_PORT": "2000"}, overrides={"redis_url": "redis://flag"})
    assert config.gateway.port == 2000
    assert config.gateway.redis_url == "redis://flag"


def test_unreadable_or_invalid_files_say_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("region = ")
    with pytest.raises(ConfigError, match="not valid toml"):
        load_config(bad)


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ({"tenants": {"bad name": {}}}, "tenants.bad name"),
        ({"tenants": {"acme": {"requests_per_minute": 0}}}, "tenants.acme.requests_per_minute"),
        ({"tenants": {"acme": {"colour": "red"}}}, "tenants.acme.colour"),
        ({"prices": {"m": {"input": 1, "output": 2}}}, "prices.m.cached_input"),
        ({"prices": {"m": {"input": "0.0000001", "cached_input": 0, "output": 1}}}, "prices.m.input"),
        ({"prices": {"m": {"input": -1, "cached_input": 0, "output": 1}}}, "prices.m.input"),
        # Past $10,000 per million tokens a request's cost could overflow the ledger's 64-bit sums (a price
        # of $10^12 made every request a 500 that was never billed).
        ({"prices": {"m": {"input": 1, "cached_input": 0, "output": "10000.000001"}}}, "prices.m.output"),
        ({"prices": {"m": {"input": 10**12, "cached_input": 0, "output": 1}}}, "prices.m.input"),
        ({"tenants": "acme"}, "tenants"),
    ],
)
def test_tenant_and_price_tables_are_validated(tables: dict[str, object], message: str) -> None:
    base = {"region": "r", "regions": [{"name": "r", "engines": [{"name": "e", "url": "http://h:1"}]}]}
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_config({**base, **tables})


def test_the_readmes_third_party_deployment_file_loads_as_written() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Fronting vLLM and SGLang", 1)[1]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    import tomllib

    config = parse_config(tomllib.loads(toml))
    kinds = [e.kind.value for e in config.topology.regions[0].engines]
    assert kinds == ["vllm", "vllm", "sglang", "openai"]
    assert config.topology.regions[0].engines[0].kv_events_replay_endpoint == "tcp://10.0.0.5:5558"


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ({"gateway": {"port": True}}, "gateway.port: must be a whole number, not true"),
        (
            {"gateway": {"port": "8080"}},
            "gateway.port: must be a whole number, not the string '8080' (write it",
        ),
        (
            {"gateway": {"auth": {"enabled": "yes"}}},
            "gateway.auth.enabled: must be true or false, not the string",
        ),
        ({"gateway": {"routing": {"kv_pull": 1}}}, "gateway.routing.kv_pull: must be true or false, not 1"),
        (
            {"gateway": {"resilience": {"stall_timeout_s": True}}},
            "gateway.resilience.stall_timeout_s: must be a",
        ),
        ({"rtt_ms": {"a.b": "80"}}, "rtt_ms.a.b: must be a number"),
        ({"tenants": {"t": {"admin": "false"}}}, "tenants.t.admin: must be true or false"),
        ({"tenants": {"t": {"requests_per_minute": True}}}, "tenants.t.requests_per_minute: must be a whole"),
    ],
)
def test_a_file_that_writes_a_number_or_a_switch_as_something_else_is_refused(
    tables: dict[str, object], message: str
) -> None:
    """Lax coercion read `port = true` as port 1 and `enabled = "yes"` as on: a file has types, so they
    are checked as written. The environment's strings are still read as numbers."""
    with pytest.raises(ConfigError) as info:
        parse_config({**_base(), **tables})
    assert message in str(info.value)
    data = _base()
    data["regions"][0]["engines"][0]["kv_capacity_blocks"] = True
    with pytest.raises(
        ConfigError, match=r"regions\.0\.engines\.0\.kv_capacity_blocks: must be a whole number"
    ):
        parse_config(data)
    assert (
        parse_config(_base(), environ={"KVGATE_PORT": "2000", "KVGATE_BLOCK_SIZE": "32"}).gateway.port == 2000
    )
    assert parse_config(_base() | {"gateway": {"health_interval_s": 2, "operator_port": None}}).gateway


def test_a_rule_across_keys_reads_as_its_own_sentence() -> None:
    """It read "<root>: Value error, engines a/e0 and ..." (pydantic's wrapping around the sentence)."""
    data = _base()
    data["regions"][0]["engines"].append({"name": "e1", "url": "http://127.0.0.1:9"})
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value).startswith("engines a/e0 and a/e1 have the same url")
    with pytest.raises(ConfigError) as info:
        parse_config(_base() | {"gateway": {"default_max_tokens": 100, "max_output_tokens": 10}})
    assert str(info.value).startswith("gateway: default_max_tokens (100) exceeds max_output_tokens (10)")
    with pytest.raises(ConfigError, match=r"default_chat_max_tokens \(100\) exceeds max_output_tokens"):
        parse_config(_base() | {"gateway": {"default_chat_max_tokens": 100, "max_output_tokens": 20}})


@pytest.mark.parametrize("url", ["10.0.0.5:8000", "localhost:8000", "engine-0.internal:8000", "10.0.0.5"])
def test_an_engine_url_without_its_scheme_says_to_add_it(url: str) -> None:
    """An engine written as host:port, the commonest slip, was refused as "Input should be a valid URL,
    relative URL without a base", or, for a host name, as "URL scheme should be 'http' or 'https'" (the
    host read as the scheme): neither says what to write."""
    data = _base()
    data["regions"][0]["engines"][0]["url"] = url
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == (
        f"regions.0.engines.0.url: {url!r} has no scheme: write http://{url} (or https://{url} for TLS)"
    )


def test_a_breaker_cooldown_longer_than_its_maximum_is_refused() -> None:
    """A failed trial doubles an open breaker's cool-down, up to breaker_max_cooldown_s. With
    breaker_cooldown_s raised past that maximum (120 against the default 60), the cool-down instead fell
    to the maximum after a failed trial: the engine that kept failing was tried again sooner."""
    data = _base()
    data["gateway"] = {"resilience": {"breaker_cooldown_s": 120}}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value).startswith("gateway.resilience: breaker_cooldown_s (120.0) exceeds "), info.value
    assert "breaker_max_cooldown_s (60.0)" in str(info.value)
    data["gateway"] = {"resilience": {"breaker_cooldown_s": 120, "breaker_max_cooldown_s": 120}}
    assert parse_config(data).gateway.resilience.breaker_cooldown_s == 120
