"""The public port under slow and malicious connections (``[gateway.edge]``): normal clients' goodput and
latency with attackers mixed in, against the same clients without them, and the gateway's memory held by
slow clients.

    python tests/bench/bench_edge.py [--concurrency 64] [--seconds 6] [--rounds 3] [--drippers 300]
                                     [--half-bodies 50] [--unauthenticated 40] [--flood 1000]

Engines are simulated and the gateway runs as ``kvgate serve`` (as in bench_flood.py), with authentication
on (a key file) and its default edge settings, except that only 127.0.0.1 is exempt from the per-client cap:
normal clients connect from 127.0.0.1, attackers from other loopback addresses (127.0.1.x), so the per-client
cap applies to them as it would to internet clients. Attackers run in a process of their own, each kind
reconnecting as soon as the gateway closes it:

- drippers: a request head sent a byte every 0.5 s (the header deadline cuts them at 10 s);
- half bodies: an authenticated request declaring 1 MiB that sends 512 KiB and stalls (the body deadline);
- unauthenticated: headers declaring 8 MiB - 1 bytes with no key, then the body as fast as it goes (401
  after the headers; the body is read and dropped, never buffered);
- a connection flood from one address (127.0.1.250), opening connections and holding every one accepted
  (the per-client cap refuses the rest with a 503 on accept).

Part 1 interleaves rounds without and with the attackers (A B A B ...), each measuring ``--seconds`` of
streaming requests at ``--concurrency`` from normal clients, and reports goodput (completed requests/s) and
p50/p99 of time to first byte and end to end as ratios against the rounds without attackers, with their
spread over rounds. Part 2 holds N slow clients of each kind (N = 0, 100, 1000) and reports the gateway's
RSS, and again once they have closed. Both parts share the machine between load generator, attackers,
engines and gateway: the ratios, measured in the same run, are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flood import MODEL, body, rss_mb, start_engines
from bench_flood import one as flood_one
from bench_gateway_overhead import pct

from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop, raise_open_file_limit
from gateway.http.upstream import UpstreamPool
from gateway.tenancy.tenants import FileKeyStore, create_key

PATH = "/v1/chat/completions"
FLOOD_ADDRESS = "127.0.1.250"


def attacker_address(i: int) -> str:
    return f"127.0.1.{1 + i % 200}"  # 200 addresses: the per-client cap (256) is not what stops them


def start_gateway(
    engines: list[EngineProcess], workdir: Path, keys_file: Path
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    engine_lines = ",\n".join(
        f'  {{ name = "{e.name}", url = "{e.url}", model = "{MODEL}" }}' for e in engines
    )
    config = workdir / f"bench-edge-{port}.toml"
    config.write_text(
        f'region = "bench"\n[[regions]]\nname = "bench"\nengines = [\n{engine_lines}\n]\n'
        f"[gateway]\nport = {port}\naccess_log = false\n"
        f'[gateway.auth]\nenabled = true\nkeys_file = "{keys_file}"\n'
        f'[gateway.edge]\nper_client_exempt = ["127.0.0.1/32"]\n'
        f"[tenants.bench]\n"
    )
    cmd = [sys.executable, "-m", "gateway.cli", "--log-level", "warning", "serve", "--config", str(config)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL), port


# -- normal clients ---------------------------------------------------------------------------------------


async def one(pool: UpstreamPool, payload: bytes, key: str) -> tuple[float, float]:
    """(time to first byte, time to the end) of one streamed answer with ``key``; raises on any error."""
    return await flood_one(pool, payload, (("Authorization", f"Bearer {key}"),))


async def goodput(pool: UpstreamPool, key: str, concurrency: int, seconds: float) -> dict[str, float]:
    """Completed requests per second with ``concurrency`` always in flight, and their latencies."""
    ttfb: list[float] = []
    e2e: list[float] = []
    errors = 0
    counter = itertools.count()
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            try:
                a, b = await one(pool, body(next(counter)), key)
                ttfb.append(a)
                e2e.append(b)
            except Exception:
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"req_s": len(e2e) / wall, "errors": errors,
            "ttfb_p50": pct(ttfb, 0.5), "ttfb_p99": pct(ttfb, 0.99),
            "e2e_p50": pct(e2e, 0.5), "e2e_p99": pct(e2e, 0.99)}  # fmt: skip


# -- attackers --------------------------------------------------------------------------------------------


async def connect(port: int, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    seen = b""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            seen = (seen + data)[:64]
    return seen


class Attack:
    """One process's attackers; counts what the gateway answered them."""

    def __init__(self, port: int, key: str) -> None:
        self.port = port
        self.key = key
        self.counts: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def verdict(self, seen: bytes) -> None:
        self.count(seen[9:12].decode("latin-1") if seen.startswith(b"HTTP/1.1 ") else "closed")

    async def forever(self, kind: Any, *args: Any) -> None:
        while True:
            try:
                await kind(*args)
            except (OSError, asyncio.IncompleteReadError):
                self.count("error")
                await asyncio.sleep(0.1)

    async def drip(self, address: str) -> None:
        reader, writer = await connect(self.port, address)
        head = f"POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n".encode()
        closed = asyncio.ensure_future(until_closed(reader))
        try:
            for i in itertools.count():
                if closed.done():
                    break
                writer.write(head[i % len(head) : i % len(head) + 1])
                await asyncio.sleep(0.5)
        except ConnectionError:
            pass
        self.verdict(await closed)
        writer.close()

    async def half_body(self, address: str) -> None:
        reader, writer = await connect(self.port, address)
        writer.write(
            f"POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 20}\r\n\r\n".encode()
            + b"x" * (512 << 10)
        )
        self.verdict(await until_closed(reader))
        writer.close()

    async def unauthenticated(self, address: str) -> None:
        reader, writer = await connect(self.port, address)
        size = (8 << 20) - 1
        writer.write(f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
        closed = asyncio.ensure_future(until_closed(reader))
        chunk = b"x" * (64 << 10)
        with contextlib.suppress(ConnectionError):
            for sent in range(0, size, len(chunk)):
                if closed.done():
                    break
                writer.write(chunk[: size - sent])
                await writer.drain()
        self.verdict(await closed)
        writer.close()

    async def flood(self, attempts_per_s: float) -> None:
        """Connections from one address at ``attempts_per_s``, each held while the gateway keeps it."""
        held: set[asyncio.Task[None]] = set()
        while True:
            task = asyncio.ensure_future(self.flood_one())
            held.add(task)
            task.add_done_callback(held.discard)
            await asyncio.sleep(1 / attempts_per_s)

    async def flood_one(self) -> None:
        try:
            reader, writer = await connect(self.port, FLOOD_ADDRESS)
        except OSError:
            self.count("error")
            return
        try:
            first = await asyncio.wait_for(reader.read(64), 0.5)
        except (TimeoutError, ConnectionError):
            first = b""
        if not first:
            self.count("held")
            first = await until_closed(reader)  # (the idle timeout, 75 s)
        self.verdict(first)
        writer.close()


def run_attackers(port: int, key: str, args: dict[str, int], stop: Any, report: Any) -> None:
    install_best_loop()
    raise_open_file_limit()

    async def main() -> None:
        attack = Attack(port, key)
        tasks = [asyncio.ensure_future(attack.forever(attack.drip, attacker_address(i)))
                 for i in range(args["drippers"])]  # fmt: skip
        tasks += [asyncio.ensure_future(attack.forever(attack.half_body, attacker_address(i)))
                  for i in range(args["half_bodies"])]  # fmt: skip
        tasks += [asyncio.ensure_future(attack.forever(attack.unauthenticated, attacker_address(i)))
                  for i in range(args["unauthenticated"])]  # fmt: skip
        if args["flood"]:
            tasks.append(asyncio.ensure_future(attack.flood(args["flood"])))
        await asyncio.to_thread(stop.wait)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        report.put(attack.counts)

    asyncio.run(main())


# -- memory held by slow clients --------------------------------------------------------------------------


SLOW_KINDS = {  # what each slow client sends before it falls silent
    "header drip": "a request head without its end",
    "half body": "a good key's head declaring 1 MiB, and 256 KiB of the body",
    "unauthenticated": "a head without a key declaring 8 MiB - 1, and 1 MiB of the body",
    "issue: 8 MiB - 1, no key": "a head without a key declaring 8 MiB - 1, and all of it but a byte",
}


async def hold(port: int, key: str, kind: str, count: int) -> list[asyncio.StreamWriter]:
    """``count`` slow clients of ``kind``, each having sent what it sends and now silent."""
    clients = []
    for i in range(count):
        _, writer = await connect(port, attacker_address(i))
        if kind == "header drip":
            head = f"POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nX-Pad: "
            writer.write(head.encode())
        elif kind == "half body":
            head = f"POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            writer.write(f"{head}Content-Length: {1 << 20}\r\n\r\n".encode() + b"x" * (256 << 10))
        else:
            size = (8 << 20) - 1
            sent = size - 1 if kind.startswith("issue") else 1 << 20
            writer.write(f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
            writer.write(b"x" * sent)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        clients.append(writer)
    return clients


async def memory_case(
    engines: list[EngineProcess], workdir: Path, keys_file: Path, key: str, kind: str, n: int
) -> dict[str, Any]:
    """The RSS of a fresh gateway (warmed up by normal requests) before, while and after ``n`` slow clients
    of ``kind`` hold what they sent: fresh, because memory freed stays in the process for reuse."""
    gateway, port = start_gateway(engines, workdir, keys_file)
    try:
        await wait_healthy([EngineProcess("bench", "gateway", port, gateway)], timeout_s=60)
        pool = UpstreamPool("127.0.0.1", port, max_idle=16)
        await goodput(pool, key, 16, 1.0)
        pool.close()
        await asyncio.sleep(0.5)
        before = rss_mb(gateway.pid)
        writers = await hold(port, key, kind, n)
        await asyncio.sleep(1.5)  # all read by the gateway (well within its deadlines)
        held = rss_mb(gateway.pid)
        for writer in writers:
            writer.close()
        await asyncio.sleep(2.0)
        return {"kind": kind, "n": n, "before": before, "held": held, "after": rss_mb(gateway.pid)}
    finally:
        gateway.terminate()
        gateway.wait(30)


async def memory(
    engines: list[EngineProcess], workdir: Path, keys_file: Path, key: str, levels: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for kind in SLOW_KINDS:
        for n in [40] if kind.startswith("issue") else levels:
            rows.append(await memory_case(engines, workdir, keys_file, key, kind, n))
    return rows


# -- the run ----------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = start_engines(args.engines, args.decode_s)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            keys_file = Path(tmp) / "keys.jsonl"
            key, _ = await create_key(FileKeyStore(keys_file), "bench")
            await wait_healthy(engines, timeout_s=60)
            rounds = await attacked_rounds(args, engines, Path(tmp), keys_file, key)
            levels = [n for n in (0, 100, 1000) if n <= args.max_slow]
            return {"rounds": rounds, "memory": await memory(engines, Path(tmp), keys_file, key, levels)}
    finally:
        stop_engines(engines)


async def attacked_rounds(
    args: argparse.Namespace, engines: list[EngineProcess], workdir: Path, keys_file: Path, key: str
) -> list[dict[str, Any]]:
    """Part 1: rounds without and with the attackers, interleaved, against one gateway."""
    gateway, port = start_gateway(engines, workdir, keys_file)
    try:
        await wait_healthy([EngineProcess("bench", "gateway", port, gateway)], timeout_s=60)
        pool = UpstreamPool("127.0.0.1", port, max_idle=args.concurrency)
        await goodput(pool, key, args.concurrency, 2.0)  # warm-up: connections, caches, the key
        attackers = {
            "drippers": args.drippers,
            "half_bodies": args.half_bodies,
            "unauthenticated": args.unauthenticated,
            "flood": args.flood_rate if args.flood else 0,
        }
        context = multiprocessing.get_context("spawn")
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            quiet = await goodput(pool, key, args.concurrency, args.seconds)
            stop, report = context.Event(), context.Queue()
            process = context.Process(target=run_attackers, args=(port, key, attackers, stop, report))
            process.start()
            # The attackers connect and settle in: by the end of the measurement the first drippers have
            # met the header deadline (10 s) and reconnected.
            await asyncio.sleep(5.0)
            attacked = await goodput(pool, key, args.concurrency, args.seconds)
            rss = rss_mb(gateway.pid)
            stop.set()
            counts = report.get(timeout=60)
            process.join(30)
            rounds.append({"quiet": quiet, "attacked": attacked, "rss_attacked": rss, "attackers": counts})
            print(f"round {r + 1}: {quiet['req_s']:.0f} req/s quiet, {attacked['req_s']:.0f} attacked; "
                  f"attackers got {counts}", file=sys.stderr)  # fmt: skip
            await asyncio.sleep(2.0)
        pool.close()
        return rounds
    finally:
        gateway.terminate()
        gateway.wait(30)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=64, help="normal clients' requests in flight")
    parser.add_argument("--seconds", type=float, default=6.0, help="each measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--decode-s", type=float, default=0.005, help="simulated seconds per output token")
    parser.add_argument("--drippers", type=int, default=300)
    parser.add_argument("--half-bodies", type=int, default=50)
    parser.add_argument("--unauthenticated", type=int, default=40)
    parser.add_argument("--flood", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--flood-rate", type=int, default=500, help="connection attempts per second")
    parser.add_argument("--max-slow", type=int, default=1000, help="largest N of part 2")
    args = parser.parse_args()
    install_best_loop()
    raise_open_file_limit()
    results = asyncio.run(run(args))
    rounds = results["rounds"]
    print(f"part 1: {args.concurrency} normal streaming clients, {args.rounds} rounds of {args.seconds:g} s "
          f"each without and with attackers ({args.drippers} drippers, {args.half_bodies} half bodies, "
          f"{args.unauthenticated} unauthenticated 8 MiB bodies, "
          f"{'a connection flood from one address' if args.flood else 'no flood'})")  # fmt: skip
    q = [r["quiet"] for r in rounds]
    a = [r["attacked"] for r in rounds]
    print(f"  without attackers: {statistics.median(x['req_s'] for x in q):.0f} req/s, "
          f"TTFB p50 {statistics.median(x['ttfb_p50'] for x in q) * 1e3:.1f} ms, "
          f"e2e p99 {statistics.median(x['e2e_p99'] for x in q) * 1e3:.1f} ms, "
          f"errors {sum(x['errors'] for x in q)}")  # fmt: skip
    print(f"  with attackers:    {statistics.median(x['req_s'] for x in a):.0f} req/s, "
          f"TTFB p50 {statistics.median(x['ttfb_p50'] for x in a) * 1e3:.1f} ms, "
          f"e2e p99 {statistics.median(x['e2e_p99'] for x in a) * 1e3:.1f} ms, "
          f"errors {sum(x['errors'] for x in a)}")  # fmt: skip
    print("  attacked / quiet, per round, median (min, max):")
    for name, metric in (("goodput", "req_s"), ("TTFB p50", "ttfb_p50"), ("TTFB p99", "ttfb_p99"),
                         ("e2e p50", "e2e_p50"), ("e2e p99", "e2e_p99")):  # fmt: skip
        print(f"    {name:9s} {spread([r['attacked'][metric] / r['quiet'][metric] for r in rounds])}")
    answered: dict[str, int] = {}
    for r in rounds:
        for k, v in r["attackers"].items():
            answered[k] = answered.get(k, 0) + v
    print(f"  what the attackers got (all rounds): {dict(sorted(answered.items()))}")
    print(f"  gateway RSS while attacked: {spread([r['rss_attacked'] for r in rounds])} MB")
    print("part 2: RSS (MB) of a fresh gateway with N slow clients holding what they sent, and after they")
    print("closed (freed memory stays in the process, for reuse)")
    for kind, sent in SLOW_KINDS.items():
        print(f"  {kind}: {sent}")
    print(f"  {'kind':26s} {'N':>5s} {'before':>8s} {'held':>8s} {'after':>8s} {'held/before':>12s}")
    for row in results["memory"]:
        print(f"  {row['kind']:26s} {row['n']:5d} {row['before']:8.1f} {row['held']:8.1f} "
              f"{row['after']:8.1f} {row['held'] / row['before']:12.2f}")  # fmt: skip
    return 0 if all(x["errors"] == 0 for x in q + a) else 1


if __name__ == "__main__":
    sys.exit(main())
