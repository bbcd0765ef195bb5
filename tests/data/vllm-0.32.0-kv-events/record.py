"""Record real KV event frames from a running vLLM: how the files beside this script were made (README.md).

    python tests/data/vllm-0.32.0-kv-events/record.py --http http://127.0.0.1:8110 \
        --pub tcp://127.0.0.1:5610 --replay tcp://127.0.0.1:5611 --out tests/data/vllm-0.32.0-kv-events

The engine must run with KV events on (ZMQ publisher binding ``tcp://*:PORT``), ``--block-size 32``,
``--num-gpu-blocks-override 65`` (so that evictions come soon), ``--max-num-batched-tokens 100`` (so that a
500-token prompt is prefilled in chunks) and ``VLLM_SERVER_DEV_MODE=1`` (for ``POST /reset_prefix_cache``).
Needs only pyzmq and msgpack (the project's own dependencies); it never imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import zmq

END_SEQ = b"\xff" * 8
QUIET_S = 1.0  # a step is over when no frame came for this long after its requests returned


class Recorder:
    def __init__(self, http: str, pub: str, replay: str) -> None:
        self.http = http.rstrip("/")
        self.replay_endpoint = replay
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.frames: list[tuple[float, list[bytes]]] = []
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()
        self.records: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while self.running:
            if poller.poll(100):
                parts = self.sub.recv_multipart()
                with self.lock:
                    self.frames.append((time.time(), parts))

    def post(self, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.http + path, data, {"content-type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read()
        return json.loads(text) if text else None

    def _drain(self) -> list[list[bytes]]:
        last = -1
        while True:
            time.sleep(QUIET_S)
            with self.lock:
                if len(self.frames) == last:
                    taken = [parts for _, parts in self.frames]
                    self.frames.clear()
                    return taken
                last = len(self.frames)

    def step(self, name: str, note: str, requests: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any]:
        leftovers = self._drain()
        assert not leftovers, f"frames arrived between steps before {name}"
        answers = [{"path": path, "answer": self.post(path, body)} for path, body in requests]
        frames = self._drain()
        seqs = []
        for parts in frames:
            self._record(name, "sub", note, parts)
            seqs.append(int.from_bytes(parts[1], "big"))
        step = {"step": name, "note": note, "requests": [], "seqs": seqs}
        for (path, body), answer in zip(requests, answers, strict=True):
            entry: dict[str, Any] = {"path": path, "body": body}
            ans = answer["answer"]
            if isinstance(ans, dict) and "usage" in ans:
                entry["usage"] = ans["usage"]
                entry["kv_transfer_params"] = ans.get("kv_transfer_params")
            else:
                entry["answer"] = ans
            step["requests"].append(entry)
        self.steps.append(step)
        print(f"{name}: {len(frames)} batches, seqs {seqs}", flush=True)
        return step

    def _record(self, step: str, socket: str, note: str, parts: list[bytes]) -> None:
        record: dict[str, Any] = {
            "step": step,
            "socket": socket,
            "note": note,
            "frames": [p.hex() for p in parts],
        }
        live = parts[1:] if socket == "replay" else parts  # a DEALER gets ROUTER's empty delimiter first
        if len(live) == 3:
            seq = int.from_bytes(live[1], "big", signed=True)
            record["seq"] = seq
            record["decoded"] = msgpack.unpackb(live[2], raw=False) if live[2] else None
        self.records.append(record)

    def replay(self, name: str, note: str, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while dealer.poll(5000):
            parts = dealer.recv_multipart()
            self._record(name, "replay", note, parts)
            seqs.append(int.from_bytes(parts[2], "big", signed=True))
            if parts[2] == END_SEQ:
                break
        dealer.close(linger=0)
        self.steps.append({"step": name, "note": note, "replay_start": start, "seqs": seqs})
        print(f"{name}: replay from {start} gave seqs {seqs}", flush=True)

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def completion(ids: list[int], max_tokens: int = 1, **extra: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, **extra}
    return "/v1/completions", body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", required=True)
    parser.add_argument("--pub", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    rng = random.Random(20260501)
    long_ids = [rng.randrange(3, 500) for _ in range(500)]  # 15 full blocks of 32 + a 20-token tail
    rec = Recorder(args.http, args.pub, args.replay)
    try:
        rec.step(
            "A-long-prompt",
            "500-token prompt, max_tokens 1; prefilled in chunks of 100 tokens "
            "(--max-num-batched-tokens 100), so its 15 full blocks arrive over several batches, "
            "each chained to the previous batch's last block by parent_block_hash",
            [completion(long_ids)],
        )
        rec.step(
            "B-repeat",
            "the same 500-token prompt again: a prefix-cache hit (cached_tokens 480) stores nothing new",
            [completion(long_ids)],
        )
        rec.step(
            "C-generated",
            "the same prompt, max_tokens 40 with ignore_eos: block 15 (prompt tokens "
            "480..499 + the first 12 generated tokens) fills during decoding and is announced",
            [completion(long_ids, 40, ignore_eos=True)],
        )
        rec.step(
            "D-cache-salt",
            "the same prompt with cache_salt 'tenant-a': other hashes for the same "
            "tokens; the salt appears as extra_keys[0] == ['tenant-a'], the other entries are null",
            [completion(long_ids, cache_salt="tenant-a")],
        )
        messages = [
            {"role": "system", "content": "You are a helpful assistant. " * 12},
            {"role": "user", "content": "Where does the KV cache of this prompt live?"},
        ]
        chat = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
        tok = rec.post("/tokenize", {"model": "tiny", "messages": messages, "add_generation_prompt": True})
        step = rec.step(
            "E-chat",
            "a chat completion, then the identical chat again (the second hits the cache and stores nothing)",
            [("/v1/chat/completions", chat), ("/v1/chat/completions", chat)],
        )
        step["chat_prompt_token_ids"] = tok["tokens"]
        evicting = 0
        for i in range(40):
            ids = [rng.randrange(3, 500) for _ in range(130)]  # 4 full blocks each
            step = rec.step(
                f"F-fill-{i:02d}",
                "a distinct 130-token prompt (4 full blocks); the KV cache holds 64 usable blocks (65 "
                "with the null block), so once no free block is left older cached blocks are evicted "
                "(BlockRemoved, one event per block, least recently used first and a request's tail "
                "blocks before its head); a batch lists its BlockRemoved events before its BlockStored",
                [completion(ids)],
            )
            if any(
                e.get("type") == "BlockRemoved"
                for r in rec.records
                if r["step"] == step["step"] and r.get("decoded")
                for e in r["decoded"][1]
            ):
                evicting += 1
                if evicting == 2:  # two prompts' worth of evictions are enough
                    break
        rec.step(
            "G-reset",
            "POST /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1) answers {'success': true} "
            "but publishes nothing by itself: AllBlocksCleared waits for the engine's next step (H)",
            [("/reset_prefix_cache", None)],
        )
        rec.step(
            "H-after-reset",
            "the 500-token prompt again after the reset: its first batch starts with "
            "the AllBlocksCleared left by G, then cached_tokens 0 and the same hashes as in A are stored "
            "again",
            [completion(long_ids)],
        )
        start = next(s for s in reversed(rec.steps) if s["step"].startswith("F-"))["seqs"][0]
        rec.replay(
            "R-replay",
            f"DEALER sends [b'', ({start}).to_bytes(8, 'big')] to the replay ROUTER: one "
            "message [b'', topic, seq, payload] per buffered batch with seq >= start (byte-identical "
            "to the live frames), then [b'', b'', ff*8, b''] as the end marker (its topic frame is EMPTY)",
            start,
        )
        last = max(r["seq"] for r in rec.records if r["socket"] == "sub")
        rec.replay(
            "S-replay-past-end",
            f"replay from {last + 1}, past the newest batch: only the end marker",
            last + 1,
        )
    finally:
        rec.close()

    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "frames.jsonl").open("w") as f:
        for record in rec.records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    prompts = {"long_prompt_token_ids": long_ids, "steps": rec.steps}
    (args.out / "requests.json").write_text(json.dumps(prompts, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
