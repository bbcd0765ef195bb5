"""A KV pull between two engines against an in-process copy of the same K/V bytes (CPU, fp32).

    python tests/bench/bench_kv_transfer.py [--positions 2048] [--layers 8] [--kv-heads 8] [--head-dim 64]
                                            [--rounds 7] [--contiguous] [--json]

A random Llama written here, shaped so that the K/V of ``--positions`` positions is tens of MB (the
defaults: 32 KiB a position, 64 MiB). A source engine process (``python -m engine engine``, ``--threads 1``,
``taskset`` to core 0) computes a prompt of that length once: its prefix cache then holds every position.
It first fills its cache with four other prompts, so that the measured prompt's blocks come from
evictions and no two of them are neighbours, as in a cache that has served for a while (``--contiguous``:
an empty cache, neighbouring blocks). This process (core 1, one torch thread) plays the decode engine and,
after a warm-up round, alternates:

- pull: ``KvImporter.pull`` of positions ``0 .. --positions`` from the source's ``POST /v1/kv/cached`` into
  a ``KVCache`` here: loopback HTTP, the source sending from its cache and computing nothing;
- copy: the same positions gathered from one ``KVCache`` into fresh tensors (``index_select`` per layer, K
  and V) and scattered into another (``index_copy_``): the least any transfer has to do;
- socket: the same number of bytes over a bare loopback TCP connection from a process on core 0 into one
  preallocated buffer here (``recv_into``): the ceiling of any transfer over TCP on this machine.

GB/s = K/V payload bytes / wall time, medians; the ratio pull / copy is the figure the target is set on (and,
steadier on a busy machine, the median of each round's own ratio). The CPU time each side spends on a pull
(the source process; this process, the receiving worker thread and its event loop) against the copy's
gives the ratio a pull reaches with a core to each side and nothing else running: what bounds it.
Progress goes to stderr, the figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pd import pinned

from engine.attention import KVCache
from engine.engine_types import ImportTicket
from engine.kv_import import KvImporter
from engine.make_model import PRESETS, Preset, make_model
from engine.model.config import ModelConfig
from engine.sequence import CacheNamespace

MODEL_NAME = "kvgate-kv-transfer-bench"
BLOCK_SIZE = 16
FIRST_TOKEN = 3  # prompt ids from here on: 0-2 are the tokenizer's specials
T0 = time.perf_counter()

# The bare-socket sender: connects to this process and sends ``n`` bytes from one buffer.
SOCKET_SENDER = """
import socket, sys
port, n, rounds = map(int, sys.argv[1:])
data = bytearray(b"\x5a") * n  # touched: untouched pages would all map the kernel's zero page
for _ in range(rounds):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.recv(1)
"""


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def write_model(directory: Path, layers: int, kv_heads: int, head_dim: int) -> Path:
    hidden = kv_heads * head_dim  # as many query heads as K/V heads: the K/V is as big as the model allows
    PRESETS["kv-transfer-bench"] = Preset(
        hidden, layers, kv_heads, kv_heads, 2 * hidden, 512, 3_000, 8192, tie_word_embeddings=False
    )
    return make_model(directory / "model", "kv-transfer-bench", seed=0, dtype="float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_source(model: Path, port: int, blocks: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        "taskset", "-c", "0", sys.executable, "-m", "engine", "engine", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--role", "both",
        "--threads", "1", "--kv-blocks", str(blocks), "--block-size", str(BLOCK_SIZE),
        "--dtype", "float32", "--device", "cpu", "--engine-id", "bench/source",
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


async def wait_healthy(session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the source engine exited ({process.returncode})")
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError("the source engine did not become healthy")


def start_socket_sender(port: int, nbytes: int, rounds: int) -> subprocess.Popen[bytes]:
    cmd = ["taskset", "-c", "0", sys.executable, "-c", SOCKET_SENDER, str(port), str(nbytes), str(rounds)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def copy_once(
    src: KVCache, dst: KVCache, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> tuple[float, float]:
    """Gather the positions' K/V out of ``src`` and scatter it into ``dst``, every layer; seconds of wall
    time and of CPU time."""
    start, cpu = time.perf_counter(), time.thread_time()
    for i in range(len(src.k)):
        dst.k[i].index_copy_(0, dst_slots, src.k[i].index_select(0, src_slots))
        dst.v[i].index_copy_(0, dst_slots, src.v[i].index_select(0, src_slots))
    return time.perf_counter() - start, time.thread_time() - cpu


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def socket_once(server: socket.socket, buf: memoryview) -> float:
    """Receive one connection's ``len(buf)`` bytes into ``buf``; seconds from its first byte."""
    conn, _ = server.accept()
    with conn:
        got = conn.recv_into(buf, len(buf))
        start = time.perf_counter()
        while got < len(buf):
            n = conn.recv_into(buf[got:], len(buf) - got)
            if not n:
                raise RuntimeError("the socket sender hung up early")
            got += n
        elapsed = time.perf_counter() - start
        conn.sendall(b"k")
    return elapsed


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    progress("writing the random model")
    model = write_model(tmp, args.layers, args.kv_heads, args.head_dim)
    mc = ModelConfig.from_dir(model)
    positions = args.positions // BLOCK_SIZE * BLOCK_SIZE
    blocks = positions // BLOCK_SIZE + 1
    per_position = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4
    nbytes = positions * per_position
    prompt = [FIRST_TOKEN + (7 * j + 11) % (mc.vocab_size - FIRST_TOKEN) for j in range(positions)]

    def cache() -> KVCache:
        return KVCache(
            mc.num_hidden_layers, blocks, BLOCK_SIZE, mc.num_key_value_heads, mc.head_dim, torch.float32
        )

    target, copy_src, copy_dst = cache(), cache(), cache()
    for t in (*copy_src.k, *copy_src.v):
        t.normal_()
    # The copy reads and writes the slots of a reversed block table: no run of blocks is contiguous.
    table = list(range(blocks))[::-1]
    slots = torch.as_tensor(
        [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(positions)], dtype=torch.long
    )
    times: dict[str, list[float]] = {"pull": [], "copy": [], "socket": []}
    cpu: dict[str, list[float]] = {"source": [], "receiver": [], "copy": []}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    source = start_source(model, port, 4 * blocks, tmp / "source.log")  # exactly 4 prompts' worth
    importer = KvImporter(target, MODEL_NAME, pull_timeout_s=300)
    server = socket.create_server(("127.0.0.1", 0))
    sock_buf = memoryview(bytearray(nbytes))
    sender: subprocess.Popen[bytes] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, source)
            if not args.contiguous:
                # Fill the source's cache with other prompts first: the measured prompt's blocks then come
                # from evictions, tail first, so no two of its blocks are neighbours (the worst case).
                progress("the source computes 4 other prompts first, to fill its cache")
                ids = range(positions)
                for i in range(4):
                    filler = [FIRST_TOKEN + (13 * j + 5 * i + 1) % (mc.vocab_size - FIRST_TOKEN) for j in ids]
                    body = {"model": MODEL_NAME, "prompt_token_ids": filler, "max_tokens": 1}
                    async with session.post(f"{url}/v1/completions", json=body) as answer:
                        if answer.status != 200:
                            raise RuntimeError(f"the source answered {answer.status}: {await answer.text()}")
            progress(f"the source computes {positions} positions ({nbytes / 2**20:.0f} MiB of K/V)")
            body = {"model": MODEL_NAME, "prompt_token_ids": prompt, "max_tokens": 1, "temperature": 0}
            async with session.post(f"{url}/v1/completions", json=body) as answer:
                if answer.status != 200:
                    raise RuntimeError(f"the source answered {answer.status}: {await answer.text()}")
            sender = start_socket_sender(server.getsockname()[1], nbytes, args.rounds + 1)
            with pinned({1}):
                for r in range(args.rounds + 1):  # round 0 warms up the connection and the allocations
                    ticket = ImportTicket(f"bench-{r}", prompt, 0, positions, table, pull=True)
                    before = importer.bytes_received
                    start, source_cpu, own_cpu = time.perf_counter(), process_cpu_s(source.pid), own_cpu_s()
                    pulled = await importer.pull(ticket, url, CacheNamespace())
                    pull_s = time.perf_counter() - start
                    source_cpu, own_cpu = process_cpu_s(source.pid) - source_cpu, own_cpu_s() - own_cpu
                    if pulled != positions or importer.bytes_received - before != nbytes:
                        raise RuntimeError(f"pulled {pulled} positions, {importer.bytes_received - before} B")
                    copy_s, copy_cpu = copy_once(copy_src, copy_dst, slots, slots)
                    socket_s = await asyncio.to_thread(socket_once, server, sock_buf)
                    if r:
                        times["pull"].append(pull_s)
                        times["copy"].append(copy_s)
                        times["socket"].append(socket_s)
                        cpu["source"].append(source_cpu)
                        cpu["receiver"].append(own_cpu)
                        cpu["copy"].append(copy_cpu)
                        now = [nbytes / s / 1e9 for s in (pull_s, copy_s, socket_s)]
                        progress(f"round {r}/{args.rounds}: pull {now[0]:.2f} GB/s, copy {now[1]:.2f} GB/s, "
                                 f"socket {now[2]:.2f} GB/s")  # fmt: skip
            if not torch.isfinite(target.k[0][slots]).all() or not target.k[-1][slots].abs().sum():
                raise RuntimeError("the pulled K/V is empty")
    finally:
        await importer.close()
        server.close()
        for process in (source, sender):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    return {
        "positions": positions,
        "payload_bytes": nbytes,
        "layers": mc.num_hidden_layers,
        "kv_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim,
        "rounds": args.rounds,
        "pull_gb_s": gbs["pull"],
        "copy_gb_s": gbs["copy"],
        "socket_gb_s": gbs["socket"],
        "ratio": gbs["pull"] / gbs["copy"],
        # Each round's pull against the copy measured right after it: steadier when the machine is busy.
        "round_ratio": statistics.median(c / p for p, c in zip(times["pull"], times["copy"], strict=True)),
        "socket_ratio": gbs["socket"] / gbs["copy"],
        "cpu_ms": {k: statistics.median(v) * 1e3 for k, v in cpu.items()},
        "seconds": times,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--contiguous",
        action="store_true",
        help="leave the source's cache empty before the measured prompt, "
        "whose blocks are then neighbours (by default they are scattered, as in a cache that has been used)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        parser.error("needs the taskset command and two cores")
    torch.set_num_threads(1)  # as the engines run (--threads 1): one core each
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-kv-transfer-") as tmp:
        r = asyncio.run(run(args, Path(tmp)))
    print(
        f"{r['positions']} positions x {r['layers']} layers x {r['kv_heads']} heads x {r['head_dim']} "
        f"(fp32): {r['payload_bytes'] / 2**20:.0f} MiB of K/V, median of {r['rounds']}:\n"
        f"  pull   {r['pull_gb_s']:.2f} GB/s\n  copy   {r['copy_gb_s']:.2f} GB/s\n"
        f"  socket {r['socket_gb_s']:.2f} GB/s (bare loopback TCP)\n"
        f"  ratio pull / copy {r['ratio']:.3f} (median of the rounds' own ratios {r['round_ratio']:.3f}; "
        f"bare socket / copy {r['socket_ratio']:.3f})"
    )
    c = r["cpu_ms"]
    print(
        f"  CPU time of a pull: source {c['source']:.0f} ms, receiver {c['receiver']:.0f} ms; of the copy "
        f"{c['copy']:.0f} ms -> with a core each, at most {c['copy'] / max(c['source'], c['receiver']):.3f}"
    )
    if args.json:
        print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
