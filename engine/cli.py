"""The engine's subcommands for the ``kvgate`` console script (entry-point group ``kvgate.commands``).

Kept import-light: the console script loads every package's ``register`` on each run, so the server and
its dependencies are imported only when the subcommand actually runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from engine.cli_args import fraction, non_negative_int, port_number, positive_float, positive_int
from engine.cli_tls import add_tls_arguments, tls_context
from engine.kv_cache_sizing import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_MEMORY_GIB,
    KvCacheSizingError,
)
from engine.responses_store import DEFAULT_CAPACITY as DEFAULT_STORED_RESPONSES

ENGINE_HELP = (
    "serve a model (Hugging Face layout) with kvgate's engine: OpenAI API, paged KV cache with prefix "
    "caching, continuous batching, KV events"
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, metavar="DIR", help="model directory (config.json, safetensors)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, required=True, help="port to listen on")
    parser.add_argument(
        "--engine-id", default=None, help="its id in KV events and /health (default: engine-<port>)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id clients use (default: DIR's name)"
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)"
    )
    parser.add_argument(
        "--kv-blocks",
        type=positive_int,
        default=None,
        help="KV cache size in blocks (default: --kv-memory-gib, else --gpu-memory-utilization)",
    )
    parser.add_argument(
        "--kv-memory-gib",
        type=positive_float,
        default=None,
        help=f"KV cache size in GiB when --kv-blocks is not given (default: on CUDA, what "
        f"--gpu-memory-utilization leaves; elsewhere {DEFAULT_KV_MEMORY_GIB})",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="on CUDA without --kv-blocks or --kv-memory-gib: the share of the GPU's memory the engine may "
        "use; the KV cache gets what the loaded model and a step's activations leave of it (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: the model's"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="sequences per step (default: 64)"
    )
    parser.add_argument(
        "--max-batched-tokens", type=positive_int, default=2048, help="token budget per step (default: 2048)"
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="default: the model's context, or what the KV cache holds if less",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="CPU threads for torch (default: all)"
    )
    parser.add_argument(
        "--compressed-weights",
        action="store_true",
        help="keep BF16 weights losslessly compressed in memory (~1.33x), each layer expanded as it runs",
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=positive_int,
        default=1,
        help="split every layer over N ranks (heads, MLP, vocabulary); one GPU each (default: 1)",
    )
    parser.add_argument(
        "--pp",
        "--pipeline-parallel-size",
        dest="pp",
        type=positive_int,
        default=1,
        help="split the layers into M pipeline stages; runs --tp x --pp worker processes (default: 1)",
    )
    parser.add_argument(
        "--role",
        choices=("prefill", "decode", "both"),
        default="both",
        help="its part in disaggregated serving, as the gateway sees it (default: both)",
    )
    parser.add_argument(
        "--max-stored-responses",
        type=non_negative_int,
        default=DEFAULT_STORED_RESPONSES,
        help="Responses API responses kept for previous_response_id and GET, the least recently used "
        "dropped first; 0 keeps none (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-core",
        choices=("auto", "process", "thread"),
        default="auto",
        help="where the scheduler and the model run: an engine core process apart from the HTTP server "
        "(which tokenizes, detokenizes and streams meanwhile), or a thread of it; auto: a process when "
        "the model runs on a GPU, a thread on CPU, where the model's threads want every core "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, run every decode step eagerly instead of replaying captured graphs (vLLM's "
        "--enforce-eager)",
    )
    add_tls_arguments(parser)


MODEL_DIR_FIX = (
    "give a model directory in Hugging Face layout (config.json, tokenizer.json, *.safetensors); "
    "kvgate make-model DIR --preset tiny writes a random one"
)


def model_dir_problem(model_dir: str) -> str | None:
    """What makes ``model_dir`` no model directory at all (one line, with the fix), or None."""
    path = Path(model_dir)
    if not path.exists():
        return f"--model {model_dir}: no such directory; {MODEL_DIR_FIX}"
    if not path.is_dir():
        return f"--model {model_dir}: not a directory; {MODEL_DIR_FIX}"
    if not (path / "config.json").is_file():
        return f"--model {model_dir}: no config.json there, so no model; {MODEL_DIR_FIX}"
    return None


def engine_core_mode(choice: str, device: str | None) -> Literal["process", "thread"]:
    """``--engine-core``'s mode: ``auto`` is a process on CUDA (the GPU computes, the host's cores are
    free to serve) and a thread on CPU (measured on 2 cores: lower cold TTFT and stream TTFT p50 in thread
    mode, throughput alike; tests/bench/bench_engine_vs_vllm.py --kvgate-only)."""
    if choice in ("process", "thread"):
        return "process" if choice == "process" else "thread"
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "process" if device.startswith("cuda") else "thread"


def run_engine(args: argparse.Namespace) -> int:
    """Load the model and serve it until SIGINT/SIGTERM; returns the exit status."""
    problem = model_dir_problem(args.model)  # (said before torch loads: a typo costs no wait)
    if problem is not None:
        print(f"kvgate engine: {problem}", file=sys.stderr)
        return 2
    from cache.tokens import TokenizerError
    from engine.llm_engine import EngineConfig
    from engine.model.errors import ModelLoadError
    from engine.parallel.distributed import ParallelConfigError
    from engine.parallel.executor import RankFailed
    from engine.server import ServerConfig
    from engine.server_main import serve

    ssl_context = tls_context(args)  # before the model loads: a bad certificate fails at once
    engine_config = EngineConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        kv_memory_gib=args.kv_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        compressed_weights=args.compressed_weights,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        cuda_graphs=args.cuda_graphs,
    )
    server_config = ServerConfig(
        engine_id=args.engine_id or f"engine-{args.port}",
        host=args.host,
        port=args.port,
        role=args.role,
        responses_stored=args.max_stored_responses,
    )
    try:
        return serve(
            engine_config,
            server_config,
            ssl_context=ssl_context,
            engine_core=engine_core_mode(args.engine_core, args.device),
            threads=args.threads,
            tls_files=None if args.tls_cert is None else (args.tls_cert, args.tls_key),
        )
    except ModelLoadError as exc:
        print(f"kvgate engine: cannot load the model: {exc}", file=sys.stderr)
        return 2
    except TokenizerError as exc:
        print(f"kvgate engine: cannot load the model's tokenizer: {exc}", file=sys.stderr)
        return 2
    except ParallelConfigError as exc:
        print(f"kvgate engine: cannot split the model: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        print(f"kvgate engine: a worker rank failed: {exc}", file=sys.stderr)
        return 1
    except KvCacheSizingError as exc:
        print(f"kvgate engine: cannot size the KV cache: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvgate engine: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the engine's subcommands to the ``kvgate`` parser."""
    parser = subparsers.add_parser("engine", help=ENGINE_HELP, description=ENGINE_HELP)
    add_engine_arguments(parser)
    parser.set_defaults(func=run_engine)
    from engine.sim import cli as sim_cli  # argparse only: importing it stays cheap

    parser = subparsers.add_parser(
        "sim-engine", help=sim_cli.SIM_ENGINE_HELP, description=sim_cli.SIM_ENGINE_HELP
    )
    sim_cli.add_sim_engine_arguments(parser)
    parser.set_defaults(func=sim_cli.run_sim_engine)
    from engine import make_model_cli  # argparse only: importing it stays cheap

    parser = subparsers.add_parser(
        "make-model", help=make_model_cli.MAKE_MODEL_HELP, description=make_model_cli.MAKE_MODEL_HELP
    )
    make_model_cli.add_arguments(parser)
    parser.set_defaults(func=make_model_cli.run_make_model)
    from engine.compress import cli as compress_cli  # argparse only: importing it stays cheap

    for name, text, run in (
        ("compress", compress_cli.COMPRESS_HELP, compress_cli.run_compress),
        ("decompress", compress_cli.DECOMPRESS_HELP, compress_cli.run_decompress),
    ):
        parser = subparsers.add_parser(name, help=text, description=text)
        compress_cli.add_arguments(parser)
        parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine COMMAND``: the engine's subcommands without the console script."""
    parser = argparse.ArgumentParser(prog="python -m engine", description="kvgate's engine commands")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args))
