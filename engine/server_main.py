"""kvgate's engine as a process: the model loaded here or in an engine core process, its app served on
uvloop until SIGINT/SIGTERM, and the line that says where (``kvgate engine``; the app is engine.server's)."""

from __future__ import annotations

import asyncio
import ssl

from aiohttp import web

from engine.core.client import EngineCoreClient
from engine.llm_engine import EngineConfig, LLMEngine
from engine.process_serving import event_loop_factory, serve_until_stopped
from engine.server import ENGINE_SERVER, EngineCoreMode, ServerConfig, build_app


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    *,
    ssl_context: ssl.SSLContext | None = None,
    engine_core: EngineCoreMode = "process",
    threads: int | None = None,
    tls_files: tuple[str, str | None] | None = None,
) -> int:
    """Load the model, serve until SIGINT/SIGTERM (on uvloop when installed), over https:// when given
    ``ssl_context`` (made of ``tls_files``, which an engine core reads to serve its KV routes the same
    way); returns the exit status. ``engine_core="process"`` loads and steps the model in an
    engine core process (``engine.core``; ``threads``: its torch CPU threads), ``"thread"`` here."""
    loop_factory = event_loop_factory()
    if engine_core == "process":
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve_core(engine_config, server_config, ssl_context, threads, tls_files))
    if threads:
        import torch

        torch.set_num_threads(threads)
    engine = LLMEngine(engine_config)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(engine, server_config, ssl_context))
    finally:
        engine.close()  # a tp/pp engine's worker processes


async def _serve_core(
    engine_config: EngineConfig,
    config: ServerConfig,
    ssl_context: ssl.SSLContext | None,
    threads: int | None,
    tls_files: tuple[str, str | None] | None = None,
) -> int:
    client = await EngineCoreClient.launch(
        engine_config, kv_host=config.host, threads=threads, tls_files=tls_files
    )
    try:
        return await _serve(client, config, ssl_context)
    finally:
        await client.stop()  # (the app's lifespan did, unless the app never started)


async def _serve(
    engine: LLMEngine | EngineCoreClient, config: ServerConfig, ssl_context: ssl.SSLContext | None
) -> int:
    app = build_app(engine, config)

    def site_for(runner: web.AppRunner) -> web.BaseSite:
        return web.TCPSite(runner, config.host, config.port, backlog=2048, ssl_context=ssl_context)

    def serving_line(url: str) -> str:
        info = app[ENGINE_SERVER].info  # (known once the app has started)
        blocks = f"{info.num_kv_blocks} KV blocks of {info.block_size}"
        if info.tensor_parallel_size * info.pipeline_parallel_size > 1:
            blocks += f", tp={info.tensor_parallel_size} pp={info.pipeline_parallel_size}"
        core = "engine core process" if isinstance(engine, EngineCoreClient) else "engine thread"
        return (
            f"kvgate engine {config.engine_id}: serving {info.model_name!r} "
            f"({info.dtype}, {info.device}, {blocks}, {core}) on {url}"
        )

    return await serve_until_stopped(
        app, site_for, serving_line, tls=ssl_context is not None, shutdown_timeout_s=5
    )
