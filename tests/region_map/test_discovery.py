"""Parsing what vLLM and SGLang say about themselves (region_map.discovery), on their real output.

The vLLM texts are verbatim excerpts of a running vLLM 0.32.0 (CPU build): ``/metrics`` of two engines under
load (one with default flags, one with ``--block-size 64 --no-enable-prefix-caching --max-num-seqs 4
--served-model-name probe-a probe-b``) and that second engine's ``/v1/models``. What no single CPU engine
can show (data-parallel ranks, LoRA adapters, SGLang) is built from the engines' source, as each test says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest

from region_map.config import EngineKind
from region_map.discovery import (
    DiscoveryError,
    ModelChoice,
    ServedModel,
    choose_model,
    parse_metrics,
    parse_models,
    parse_server_info,
)

# vLLM 0.32.0, --block-size 64 --no-enable-prefix-caching --max-num-seqs 4, 16 requests sent at once: 4
# running, 12 waiting. Lines 1-10, 55-93, 289-318 and 552-554 of its /metrics, unchanged.
VLLM_QUEUED = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14439.0
python_gc_objects_collected_total{generation="1"} 2469.0
python_gc_objects_collected_total{generation="2"} 580.0
# HELP python_gc_objects_uncollectable_total Uncollectable objects found during GC
# TYPE python_gc_objects_uncollectable_total counter
python_gc_objects_uncollectable_total{generation="0"} 0.0
python_gc_objects_uncollectable_total{generation="1"} 0.0
python_gc_objects_uncollectable_total{generation="2"} 0.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="probe-a"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="probe-a"} 12.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="probe-a",reason="capacity"} 12.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="probe-a",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="probe-a",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="probe-a",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="probe-a",sleep_state="discard_all"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="probe-a"} 0.0012817578393224949
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="probe-a"} 0.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="probe-a"} 1.7961310147439063e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="probe-a"} 0.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="probe-a"} 1.7961310147439165e+09
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="probe-a"} 0.0
# HELP vllm:external_prefix_cache_queries_created External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.
# TYPE vllm:external_prefix_cache_queries_created gauge
vllm:external_prefix_cache_queries_created{engine="0",model_name="probe-a"} 1.7961310147439277e+09
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="probe-a"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="probe-a"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="probe-a"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="probe-a"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="probe-a"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="probe-a"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="7.5",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="10.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="20.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="40.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="80.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="160.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="640.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="probe-a"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="probe-a"} 0.17408514022827148
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="probe-a"} 1.7961310147444043e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="64",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="64",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="False",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="2048.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="4194304",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="65536",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="True"} 1.0
"""  # noqa: E501

# vLLM 0.32.0 with its CPU defaults (block size 128, prefix caching on), 40 requests in flight.
VLLM_BUSY = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="probe-model"} 40.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="probe-model"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="probe-model",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="probe-model",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="probe-model",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="probe-model",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="probe-model",sleep_state="discard_all"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="probe-model"} 0.009765923032319157
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="2048.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="4194304",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="32768",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0
"""  # noqa: E501

# The /v1/models of the engine of VLLM_QUEUED (its model directory's path replaced).
VLLM_MODELS = """
{"object":"list","data":[{"id":"probe-a","object":"model","created":1796131026,"owned_by":"vllm","root":"/models/probe","parent":null,"max_model_len":2048,"permission":[{"id":"modelperm-ae05fb9ee1a425c2","object":"model_permission","created":1796131026,"allow_create_engine":false,"allow_sampling":true,"allow_logprobs":true,"allow_search_indices":false,"allow_view":true,"allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]},{"id":"probe-b","object":"model","created":1796131026,"owned_by":"vllm","root":"/models/probe","parent":null,"max_model_len":2048,"permission":[{"id":"modelperm-8aa4d1e4517e41eb","object":"model_permission","created":1796131026,"allow_create_engine":false,"allow_sampling":true,"allow_logprobs":true,"allow_search_indices":false,"allow_view":true,"allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]}]}
"""


def test_vllm_load_block_size_and_cache_settings_from_its_metrics() -> None:
    m = parse_metrics(EngineKind.VLLM, VLLM_QUEUED)
    # vllm:num_requests_waiting_by_reason repeats the 12 waiting requests: it must not be added to them.
    assert (m.running, m.waiting) == (4, 12)
    assert m.kv_usage == pytest.approx(0.0012817578393224949)
    assert (m.block_size, m.prefix_caching, m.hash_algo) == (64, False, "sha256")
    assert m.kv_capacity_blocks == 65536


def test_vllm_with_its_defaults() -> None:
    m = parse_metrics(EngineKind.VLLM, VLLM_BUSY)
    assert (m.running, m.waiting) == (40, 0)
    assert m.kv_usage == pytest.approx(0.009765923032319157)
    assert (m.block_size, m.prefix_caching, m.kv_capacity_blocks) == (128, True, 32768)


def _second_rank(text: str, values: dict[str, str]) -> str:
    """``text`` with a data-parallel rank 1 beside rank 0, as vLLM writes it: one series per engine index,
    labelled engine="1" (vllm/v1/metrics/loggers.py per_engine_labelvalues; log_metrics_info labels the
    cache_config_info of each index the same way)."""
    out = []
    for line in text.splitlines():
        out.append(line)
        sample = re.match(r'^([a-z_:]+)\{(.*)engine="0"(.*)\} (\S+)$', line)
        if sample and sample.group(1) in values:
            name, before, after, value = sample.groups()
            out.append(f'{name}{{{before}engine="1"{after}}} {values[name] or value}')
    return "\n".join(out) + "\n"


def test_data_parallel_ranks_add_their_queues_and_average_their_caches() -> None:
    text = _second_rank(
        VLLM_QUEUED,
        {
            "vllm:num_requests_running": "3.0",
            "vllm:num_requests_waiting": "5.0",
            "vllm:kv_cache_usage_perc": "0.5",
            "vllm:cache_config_info": "",  # the same labels but for engine
        },
    )
    assert text.count('engine="1"') == 4
    m = parse_metrics(EngineKind.VLLM, text)
    assert (m.running, m.waiting) == (4 + 3, 12 + 5)
    assert m.kv_usage == pytest.approx((0.0012817578393224949 + 0.5) / 2)
    assert m.block_size == 64


def _sglang_metrics(series: Sequence[tuple[dict[str, str], tuple[float, float, float]]]) -> str:
    """A /metrics page written as SGLang writes it: prometheus_client gauges named in
    srt/metrics/collector.py (SchedulerMetricsCollector), labelled as srt/managers/scheduler_metrics_mixin.py
    labels them (model_name, engine_type, tp_rank, pp_rank, and dp_rank under data parallelism)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    names = list(series[0][0])
    running = Gauge("sglang:num_running_reqs", "The number of running requests.", names, registry=registry)
    queued = Gauge(
        "sglang:num_queue_reqs", "The number of requests in the waiting queue.", names, registry=registry
    )
    usage = Gauge("sglang:token_usage", "The token usage.", names, registry=registry)
    hit = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", names, registry=registry)
    for labels, (r, q, u) in series:
        running.labels(**labels).set(r)
        queued.labels(**labels).set(q)
        usage.labels(**labels).set(u)
        hit.labels(**labels).set(0.5)
    return generate_latest(registry).decode()


def _sglang_labels(**ranks: str) -> dict[str, str]:
    return {"model_name": "Qwen/Qwen3-8B", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", **ranks}


def test_sglang_load_from_its_metrics() -> None:
    m = parse_metrics(EngineKind.SGLANG, _sglang_metrics([(_sglang_labels(), (3, 7, 0.25))]))
    assert (m.running, m.waiting, m.kv_usage) == (3, 7, 0.25)
    assert m.block_size is None and m.prefix_caching is None  # SGLang says those on /server_info


def test_sglang_tensor_parallel_ranks_repeat_one_queue_and_data_parallel_ranks_add_up() -> None:
    # --enable-metrics-for-all-schedulers: every TP rank of one DP rank reports the same scheduler queue.
    tp = [(_sglang_labels(tp_rank="0"), (3, 7, 0.25)), (_sglang_labels(tp_rank="1"), (3, 7, 0.25))]
    assert parse_metrics(EngineKind.SGLANG, _sglang_metrics(tp)).running == 3
    dp = [
        (_sglang_labels(tp_rank="0", dp_rank="0"), (3, 7, 0.2)),
        (_sglang_labels(tp_rank="1", dp_rank="1"), (2, 1, 0.4)),
    ]
    m = parse_metrics(EngineKind.SGLANG, _sglang_metrics(dp))
    assert (m.running, m.waiting) == (5, 8)
    assert m.kv_usage == pytest.approx(0.3)


def test_a_page_without_the_gauges_reads_as_no_load_and_garbage_is_refused() -> None:
    login = "<html><body>Sign in to continue</body></html>\n"
    m = parse_metrics(EngineKind.VLLM, login)
    assert (m.running, m.waiting, m.kv_usage, m.block_size) == (None, None, None, None)
    # The SGLang gauges are not vLLM's: a vLLM reading of an SGLang page finds nothing.
    assert parse_metrics(EngineKind.VLLM, _sglang_metrics([(_sglang_labels(), (3, 7, 0.25))])).running is None
    broken = VLLM_BUSY.replace(
        'vllm:num_requests_running{engine="0",', 'vllm:num_requests_running{engine="0"'
    )
    with pytest.raises(DiscoveryError, match="not Prometheus text"):
        parse_metrics(EngineKind.VLLM, broken)


def test_the_models_a_real_vllm_lists_and_the_one_taken() -> None:
    served = parse_models(json.loads(VLLM_MODELS))
    assert served == [ServedModel("probe-a"), ServedModel("probe-b")]
    taken = choose_model(served, None)
    assert taken.model == "probe-a" and taken.error is None
    assert taken.note is not None and "probe-a, probe-b" in taken.note and "the first it lists" in taken.note
    assert choose_model(served, "probe-b") == ModelChoice("probe-b")  # configured and listed: no note
    assert choose_model(served[:1], None).note is None  # one model: nothing to say


def test_a_configured_model_it_does_not_serve_is_a_contradiction() -> None:
    served = parse_models(json.loads(VLLM_MODELS))
    verdict = choose_model(served, "meta-llama/Llama-3.1-8B-Instruct")
    assert verdict.model is None
    assert (
        verdict.error
        == "serves probe-a, probe-b, not meta-llama/Llama-3.1-8B-Instruct (the configured model)"
    )
    assert choose_model([], None).error == "/v1/models lists no model"
    assert choose_model([], "m").error == "serves no model at all, not m (the configured model)"


def _lora_card(name: str, base: str) -> dict[str, Any]:
    # vllm/entrypoints/openai/models/serving.py show_available_models: an adapter's card has its path as
    # root and its base model as parent (and no max_model_len).
    return {"id": name, "object": "model", "created": 1796131026, "owned_by": "vllm",
            "root": f"/adapters/{name}", "parent": base, "max_model_len": None, "permission": []}  # fmt: skip


def test_lora_adapters_are_not_taken_unless_configured() -> None:
    base = json.loads(VLLM_MODELS)["data"][0]
    # vLLM lists base models first; a server that lists an adapter first must still not get the base's name
    # taken from under it.
    payload = {"object": "list", "data": [_lora_card("sql-lora", "probe-a"), base]}
    served = parse_models(payload)
    assert served == [ServedModel("sql-lora", parent="probe-a"), ServedModel("probe-a")]
    taken = choose_model(served, None)
    assert taken.model == "probe-a"
    assert taken.note is not None and "the first that is not a LoRA adapter" in taken.note
    assert choose_model(served, "sql-lora").model == "sql-lora"  # the operator may route an adapter by name


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [],
        {"object": "list"},
        {"data": "probe-a"},
        {"data": [{"object": "model"}]},
        {"data": [{"id": ""}]},
    ],
)
def test_a_models_answer_of_another_shape_is_refused(payload: Any) -> None:
    with pytest.raises(DiscoveryError):
        parse_models(payload)


def test_sglang_server_info() -> None:
    # srt/entrypoints/http_server.py server_info: dataclasses.asdict(server_args) merged with the scheduler's
    # info, internal_states and version (a few of its ~300 keys).
    payload = {
        "model_path": "Qwen/Qwen3-8B", "served_model_name": "Qwen/Qwen3-8B", "page_size": 32,
        "disable_radix_cache": False, "max_running_requests": 48, "tp_size": 1, "dp_size": 1,
        "max_total_num_tokens": 412160, "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.5.9",
    }  # fmt: skip
    info = parse_server_info(payload)
    assert (info.page_size, info.prefix_caching, info.max_running) == (32, True, 48)
    off = parse_server_info(
        {**payload, "page_size": None, "disable_radix_cache": True, "max_running_requests": None}
    )
    assert (off.page_size, off.prefix_caching, off.max_running) == (None, False, None)
    with pytest.raises(DiscoveryError):
        parse_server_info(["not", "an", "object"])


def test_gauges_and_labels_too_large_for_a_count_read_as_none() -> None:
    """Values no engine means (two data-parallel ranks of 1e308 requests each, a block size of 5,000 digits)
    are no reading: they raised OverflowError and ValueError out of the health probe, which then took the
    engine for failing its check, with an error and its traceback in the log."""
    one = re.sub(r"^(vllm:num_requests_running\{.*\}) \S+$", r"\1 1.7e308", VLLM_QUEUED, flags=re.M)
    text = _second_rank(one, {"vllm:num_requests_running": "", "vllm:cache_config_info": ""})
    assert text.count(" 1.7e308\n") == 2
    m = parse_metrics(EngineKind.VLLM, text)
    assert m.running is None and m.waiting == 12
    huge = re.sub(r'block_size="\d+"', 'block_size="' + "9" * 5000 + '"', VLLM_QUEUED)
    assert parse_metrics(EngineKind.VLLM, huge).block_size is None
