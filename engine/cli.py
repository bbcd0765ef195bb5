"""The engine's subcommands for the ``kvgate`` console script (entry-point group ``kvgate.commands``).

Kept import-light: the console script loads every package's ``register`` on each run, so the server and
its dependencies are imported only when the subcommand actually runs.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine.cli_args import fraction, non_negative_int, port_number, positive_float, positive_int, seconds
from engine.kv_cache_sizing import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_MEMORY_GIB,
    KvCacheSizingError,
)

if TYPE_CHECKING:
    import ssl

    from engine.sim.config import SimEngineConfig

SIM_ENGINE_HELP = (
    "run the SIMULATED engine: an OpenAI-compatible server with a cost model, for tests and benchmarks"
)
ENGINE_HELP = (
    "serve a model (Hugging Face layout) with kvgate's engine: OpenAI API, paged KV cache with prefix "
    "caching, continuous batching, KV events"
)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``/``--tls-key``: serve https:// (the gateway then reaches it over TLS)."""
    parser.add_argument(
        "--tls-cert", metavar="PEM", help="serve https:// with this certificate chain (PEM; may hold the key)"
    )
    parser.add_argument(
        "--tls-key", metavar="PEM", help="the certificate's private key (PEM; default: in --tls-cert)"
    )


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The server context of ``--tls-cert``/``--tls-key``, or None for plain http; exits on unusable files."""
    if args.tls_cert is None:
        if args.tls_key is not None:
            raise SystemExit("kvgate: --tls-key needs --tls-cert (the certificate it belongs to)")
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ValueError) as exc:  # a missing file, or not a PEM certificate with its key
        raise SystemExit(f"kvgate: cannot use --tls-cert {args.tls_cert}: {exc}") from None
    return context


def add_sim_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's flags; shared by ``kvgate sim-engine`` and ``python -m engine.sim``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=port_number,
        required=True,
        help="port to listen on; 0 picks a free one (printed on stderr)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=non_negative_int,
        default=4096,
        help="prefix cache capacity in blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default: %(default)s)"
    )
    parser.add_argument(
        "--model", default="kvgate-sim", help="the model name it serves (default: %(default)s)"
    )
    parser.add_argument(
        "--engine-id", default=None, help="its id in KV events and /health (default: sim-<port>)"
    )
    parser.add_argument(
        "--prefill-s-per-token",
        type=seconds,
        default=5e-5,
        help="simulated prefill cost per uncached prompt token, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-s-per-token",
        type=seconds,
        default=0.02,
        help="simulated decode cost per output token, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-pull-s-per-token",
        type=seconds,
        default=1.2e-5,
        help="simulated cost of sending a cached token's K/V to a peer that pulls it (default: %(default)s)",
    )
    parser.add_argument(
        "--profile",
        metavar="NAME",
        help="batching mode: requests share one step loop costed by this perfmodel engine profile "
        "(llama3-8b-h100, llama3-70b-h100, ...), so they queue behind each other's work; "
        "--prefill-s-per-token, --decode-s-per-token and --max-running are then not used "
        "(default: every request is costed on its own)",
    )
    parser.add_argument(
        "--profile-overrides",
        metavar="K=V,...",
        default="",
        help="replace some of the profile's constants, e.g. step_fixed_s=0.004,max_batch_tokens=2048",
    )
    parser.add_argument(
        "--max-running",
        type=positive_int,
        default=64,
        help="requests processed at once; more wait FIFO (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=131072,
        help="largest prompt + max_tokens accepted (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenize with this Hugging Face tokenizer directory (default: byte-level); reported as its "
        "model path to routers that ask",
    )
    add_tls_arguments(parser)


def run_sim_engine(args: argparse.Namespace) -> int:
    """Serve the simulator until SIGINT/SIGTERM; returns the exit status."""
    from engine.sim.run import serve

    ssl_context = tls_context(args)
    sock: socket.socket | None = None
    port: int = args.port
    if port == 0:
        # Bind first so that the default engine id can name the port actually used.
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, 0), family=family)
        port = sock.getsockname()[1]
    try:
        config = _sim_engine_config(args, port)
    except ValueError as exc:  # an unknown --profile or an unusable --profile-overrides
        raise SystemExit(f"kvgate sim-engine: {exc}") from None
    try:
        return serve(config, sock=sock, ssl_context=ssl_context)
    except OSError as exc:  # the address is taken, or not ours to bind: say so without a traceback
        print(f"kvgate sim-engine: cannot serve on {args.host}:{port}: {exc}", file=sys.stderr)
        return 1


def _sim_engine_config(args: argparse.Namespace, port: int) -> SimEngineConfig:
    from engine.sim.config import SimEngineConfig

    return SimEngineConfig(
        engine_id=args.engine_id or f"sim-{port}",
        model=args.model,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        prefill_s_per_token=args.prefill_s_per_token,
        decode_s_per_token=args.decode_s_per_token,
        kv_pull_s_per_token=args.kv_pull_s_per_token,
        max_running=args.max_running,
        host=args.host,
        port=port,
        max_model_len=args.max_model_len,
        tokenizer=args.tokenizer,
        profile=args.profile,
        profile_overrides=args.profile_overrides,
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
        "--max-model-len", type=positive_int, default=None, help="default: the model's context"
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
    from engine.server import ServerConfig, serve

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
        engine_id=args.engine_id or f"engine-{args.port}", host=args.host, port=args.port, role=args.role
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
    parser = subparsers.add_parser("sim-engine", help=SIM_ENGINE_HELP, description=SIM_ENGINE_HELP)
    add_sim_engine_arguments(parser)
    parser.set_defaults(func=run_sim_engine)
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


def sim_engine_main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.sim``: the same simulator without the console script."""
    parser = argparse.ArgumentParser(prog="python -m engine.sim", description=SIM_ENGINE_HELP)
    add_sim_engine_arguments(parser)
    return run_sim_engine(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine COMMAND``: the engine's subcommands without the console script."""
    parser = argparse.ArgumentParser(prog="python -m engine", description="kvgate's engine commands")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args))
