"""What crosses between the API process and the engine core: requests (generations, embeddings) and aborts
one way, one :class:`StepBatch` per engine step the other, each a length-prefixed pickle on a private socket
pair."""

from __future__ import annotations

import pickle
import struct
from asyncio import StreamReader, StreamWriter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cache.events import KvEvent
from engine.async_engine import EngineDead
from engine.engine_types import RequestRejected, StepOutput
from engine.kv_transfer import KvTransferError
from engine.sequence import CacheNamespace, SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

_LENGTH = struct.Struct("!I")
# Errors that reach the API side as what they are; any other one as a RuntimeError with its message.
_PORTABLE = (RequestRejected, KvTransferError, EngineDead)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the API process needs to know of the engine it serves (the model itself stays in the core)."""

    model_name: str
    block_size: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    device: str
    dtype: str  # "float32", "bfloat16", ...
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_pull: bool = True  # the K/V cache is in the process that serves the KV routes: transfers work
    kv_port: int | None = None  # process mode: the core's own server of the KV source routes
    kv_tls: bool = False  # ... served over https (the API server's certificate)

    @classmethod
    def of(cls, llm: LLMEngine, kv_port: int | None = None, kv_tls: bool = False) -> EngineInfo:
        config = llm.config
        return cls(
            model_name=llm.model_name,
            block_size=config.block_size,
            max_model_len=llm.max_model_len,
            vocab_size=llm.model_config.vocab_size,
            num_kv_blocks=llm.blocks.num_blocks,
            device=str(llm.device),
            dtype=str(llm.dtype).removeprefix("torch."),
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            kv_pull=llm.kv_cache is not None,  # a tp/pp engine's cache lives in its workers
            kv_port=kv_port,
            kv_tls=kv_tls,
        )


# -- API process -> core --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: CacheNamespace
    prefill_url: str | None = None
    pull_url: str | None = None
    pull_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Embed:
    """A prompt whose last hidden state the API process wants (``/v1/embeddings``); aborted as a request."""

    request_id: str
    prompt_token_ids: list[int]
    namespace: CacheNamespace


@dataclass(frozen=True, slots=True)
class Abort:
    request_ids: tuple[str, ...]


# -- core -> API process ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class StartupFailed:
    error: BaseException


@dataclass(slots=True)
class StepBatch:
    """One engine step's news (or, between steps, the load after aborts): its outputs (token ids, no text),
    the requests that failed alone, its KV events, the load and counters after it."""

    outputs: list[StepOutput] = field(default_factory=list)
    embeddings: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (request id, last hidden state)
    failures: list[tuple[str, BaseException]] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)
    load: dict[str, int] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)  # busy seconds and KV pull counts (cumulative)
    steps: int = 0
    error: str | None = None  # the step loop failed: the engine serves nothing more
    failure: str | None = None  # a worker rank died


def portable(exc: BaseException) -> BaseException:
    """``exc`` as it can cross to the API process and still be told apart there."""
    return exc if isinstance(exc, _PORTABLE) else RuntimeError(str(exc) or type(exc).__name__)


def send(writer: StreamWriter, message: object) -> None:
    """Queue one message (the transport buffers it: the loop never blocks on a slow reader)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(payload)) + payload)


async def receive(reader: StreamReader) -> Any:
    """The next message; ``asyncio.IncompleteReadError`` once the other side is gone."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))
