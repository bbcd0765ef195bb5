"""Getting every usage record into the ledger exactly once, also while Redis is away.

Records queue up in memory (never dropped) and one task writes them. If a write fails, that record and
every later one go to the local spool (fsync'ed) until Redis answers again; then the spool is replayed and
cleared. A gateway that starts with a non-empty spool (it stopped during an outage) replays it first. The
ledger ignores a record id it has seen, so a record written just before a failure and spooled anyway still
counts once.

With a journal (``cache.journal``), what a crashed predecessor owed is written first, and every record safely
in the ledger or the spool is reported to the journal, which then forgets its entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from cache.journal import CostFn, JournalLocked, UsageJournal
from cache.ledger import UsageLedger, UsageRecord
from cache.spool import Spool
from region_map.config import ConfigError

log = logging.getLogger("kvgate.ledger")

MAX_BATCH = 256


class LedgerWriter:
    def __init__(
        self,
        ledger: UsageLedger,
        spool: Spool | None = None,
        *,
        journal: UsageJournal | None = None,
        write_timeout_s: float = 2.0,
        retry_s: float = 1.0,
    ) -> None:
        self.ledger = ledger
        self.spool = spool
        self.journal = journal
        self._write_timeout_s = write_timeout_s
        self._retry_s = retry_s
        self._queue: asyncio.Queue[UsageRecord] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._record_now: Callable[[UsageRecord], bool] | None = getattr(ledger, "record_now", None)
        self.degraded = False  # Redis is away: records go to the spool
        self.submitted = 0  # records handed in, ever: a read of the ledger made since then may miss them
        self.written = 0
        self.spooled = 0

    def submit(self, rec: UsageRecord) -> None:
        self.submitted += 1
        if self._record_now is not None:
            self._record_now(rec)  # the in-process ledger cannot fail: no queue, no task switch
            self.written += 1
            self._settled([rec])
            return
        self._queue.put_nowait(rec)

    def _settled(self, records: list[UsageRecord]) -> None:
        if self.journal is not None:
            self.journal.settled(r.record_id for r in records)

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def _to_spool(self, records: list[UsageRecord]) -> None:
        if self.spool is None:
            raise RuntimeError("a ledger write failed and there is no spool")  # memory ledgers never fail
        await asyncio.to_thread(self.spool.append, records)
        self.spooled += len(records)
        self._settled(records)

    async def replay(self) -> bool:
        """Write the spool to the ledger and clear it; False if the ledger is still away."""
        if self.spool is None:
            return True
        records = await asyncio.to_thread(self.spool.read)
        if not records:
            return True
        try:
            await self._write_all(records)
        except Exception as exc:  # still away
            log.debug("spool replay failed: %s", exc)
            return False
        await asyncio.to_thread(self.spool.clear, len(records))
        log.info("replayed %d spooled usage records into the ledger", len(records))
        return True

    def _take_batch(self, first: UsageRecord) -> list[UsageRecord]:
        batch = [first]
        while len(batch) < MAX_BATCH and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    def _done(self, count: int) -> None:
        for _ in range(count):
            self._queue.task_done()

    async def _run(self) -> None:
        while True:
            if self.degraded:
                try:
                    async with asyncio.timeout(self._retry_s):
                        first = await self._queue.get()
                except TimeoutError:
                    pass
                else:
                    batch = self._take_batch(first)
                    try:
                        await self._to_spool(batch)
                    finally:
                        self._done(len(batch))
                if await self.replay():
                    self.degraded = False
                    log.warning("ledger reachable again; spool replayed")
                continue
            # Everything queued goes in one batch (one Redis round trip), so the writer keeps up with
            # any request rate.
            batch = self._take_batch(await self._queue.get())
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await self.ledger.record_many(batch)
                self.written += len(batch)
                self._settled(batch)
            except asyncio.CancelledError:
                await self._to_spool(batch)
                raise
            except Exception as exc:  # Redis went away: this batch and the next ones go to the spool
                log.warning("ledger write failed (%s); spooling usage records until it is back", exc)
                self.degraded = True
                await self._to_spool(batch)
            finally:
                self._done(len(batch))

    async def start(self, cost: CostFn | None = None) -> None:
        """Replay a spool left by an earlier run, then the records a journal says it still owed (``cost``
        prices the estimated ones), then start writing."""
        self.degraded = not await self.replay()
        if self.journal is not None:
            try:
                owed = await asyncio.to_thread(self.journal.start, cost or _free)
            except JournalLocked as exc:
                raise ConfigError(f"gateway.spool_path: {exc}") from None
            except OSError as exc:
                raise ConfigError(f"gateway.spool_path: cannot keep the usage journal there: {exc}") from None
            if owed:
                await self._write_or_spool(owed)
                log.warning("billed %d requests an earlier gateway process left unrecorded", len(owed))
            self.journal.forget_replayed()
        self._task = asyncio.create_task(self._run(), name="kvgate-ledger")

    async def _write_all(self, records: list[UsageRecord]) -> None:
        """Write ``records`` to the ledger, a batch (one round trip) at a time; raises if it fails."""
        for i in range(0, len(records), MAX_BATCH):
            async with asyncio.timeout(self._write_timeout_s):
                await self.ledger.record_many(records[i : i + MAX_BATCH])

    async def _write_or_spool(self, records: list[UsageRecord]) -> None:
        try:
            await self._write_all(records)
        except Exception as exc:  # whatever failed, the spool keeps them
            log.warning("ledger write failed (%s); spooling %d records", exc, len(records))
            self.degraded = True
            await self._to_spool(records)

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every submitted record is in the ledger or the spool."""
        async with asyncio.timeout(timeout_s):
            await self._queue.join()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (or spool it), then stop. Nothing submitted is lost."""
        with contextlib.suppress(TimeoutError):
            await self.flush(timeout_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        rest = []
        while not self._queue.empty():
            rest.append(self._queue.get_nowait())
        if rest:
            await self._to_spool(rest)
        if self.journal is not None:
            self.journal.close()


def _free(model: str, prompt: int, cached: int, completion: int) -> int:
    return 0
