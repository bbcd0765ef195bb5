"""Getting every usage record into the ledger exactly once, also while Redis is away.

Records queue up in memory (never dropped) and one task writes them. If a write fails, that record and
every later one go to the local spool (fsync'ed) until Redis answers again; then the spool is replayed and
cleared. A gateway that starts with a non-empty spool (it stopped during an outage) replays it first. The
ledger ignores a record id it has seen, so a record written just before a failure and spooled anyway still
counts once. A spool that refuses a write (a full disk, a removed or read-only directory) does not stop the
writer: the records it refused stay in memory, and are offered to the spool and to the ledger again every
``retry_s`` until one of them takes them.

With a journal (``cache.journal``), what a crashed predecessor owed is written first, and every record safely
in the ledger or the spool is reported to the journal, which then forgets its entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from cache.cancelling import cancel_and_wait
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
        self._watch: asyncio.Task[None] | None = None  # the journal's directory, while it has one
        self._record_now: Callable[[UsageRecord], bool] | None = getattr(ledger, "record_now", None)
        self.degraded = False  # Redis is away: records go to the spool
        self.spool_failing = False  # ... and the spool refuses them: they wait in ``_unsaved``
        # Records taken off the queue that neither the ledger nor the spool holds yet (still unfinished in
        # the queue's count, so that ``flush`` waits for them too).
        self._unsaved: list[UsageRecord] = []
        # Records taken off the queue and not yet safe: in ``_unsaved``, or in a write or spool append under
        # way (in neither the queue nor ``_unsaved``: ``pending`` counted them as 0 for that while).
        self._taken = 0
        # Record ids a crashed predecessor owed that are not yet safe here: its journal stays until they are.
        self._owed: set[str] = set()
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
            if self._owed:
                self._owed.difference_update(r.record_id for r in records)
                if not self._owed:
                    self.journal.forget_replayed()

    @property
    def pending(self) -> int:
        """Records not yet in the ledger or the spool."""
        return self._queue.qsize() + self._taken

    @property
    def state(self) -> str:
        """ "ok"; "spooling" (the ledger is away: records go to the spool); or "unsaved" (the spool refuses
        them too: they wait in memory)."""
        if self.spool_failing:
            return "unsaved"
        return "spooling" if self.degraded else "ok"

    async def _to_spool(self, records: list[UsageRecord]) -> None:
        if self.spool is None:
            raise RuntimeError("a ledger write failed and there is no spool")  # memory ledgers never fail
        await asyncio.to_thread(self.spool.append, records)
        self.spooled += len(records)
        self._settled(records)

    async def _spool_or_keep(self, records: list[UsageRecord]) -> None:
        """Spool ``records`` taken off the queue, or keep them in ``_unsaved`` if the spool refuses them."""
        try:
            await self._to_spool(records)
        except asyncio.CancelledError:
            self._unsaved.extend(records)  # (``stop`` takes them over)
            raise
        except Exception as exc:
            self._unsaved.extend(records)
            self._spool_refused(exc)
            return
        self._done(len(records))
        if self.spool_failing:
            self.spool_failing = False
            log.warning("the ledger spool takes writes again: usage records waiting in memory are spooled")

    def _spool_refused(self, exc: BaseException) -> None:
        if not self.spool_failing:  # said once per episode: the writer retries every ``retry_s``
            self.spool_failing = True
            where = self.spool.path if self.spool is not None else "(none)"
            log.error(
                "cannot write the ledger spool at %s (%s): usage records wait in memory, offered to the "
                "spool and the ledger again every %gs; free the disk or restore the directory",
                where,
                exc,
                self._retry_s,
            )

    async def _write_unsaved(self) -> bool:
        """Write the records the spool refused straight to the ledger; False if it is away too."""
        records = self._unsaved
        if not records:
            return True
        if not await self._ledger_took(records, "writing records the spool refused"):
            return False
        self._unsaved = []
        self.written += len(records)
        self._settled(records)
        self._done(len(records))
        return True

    async def replay(self) -> bool:
        """Write the spool to the ledger and clear it; False if the ledger is still away (or the spool
        cannot be read)."""
        if self.spool is None:
            return True
        try:
            records = await asyncio.to_thread(self.spool.read)
        except OSError as exc:
            self._spool_refused(exc)
            return False
        if not records:
            return True
        if not await self._ledger_took(records, "spool replay"):
            return False
        try:
            await asyncio.to_thread(self.spool.clear, len(records))
        except OSError as exc:  # written, not cleared: the next replay writes them again, counted once
            self._spool_refused(exc)
            return False
        log.info("replayed %d spooled usage records into the ledger", len(records))
        return True

    def _take_batch(self, first: UsageRecord) -> list[UsageRecord]:
        batch = [first]
        while len(batch) < MAX_BATCH and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        self._taken += len(batch)
        return batch

    def _done(self, count: int) -> None:
        self._taken -= count
        for _ in range(count):
            self._queue.task_done()

    async def _run(self) -> None:
        while True:
            if self.degraded:
                await self._degraded_round()
                continue
            # Everything queued goes in one batch (one Redis round trip), so the writer keeps up with
            # any request rate.
            batch = self._take_batch(await self._queue.get())
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await self.ledger.record_many(batch)
            except asyncio.CancelledError:
                self._unsaved.extend(batch)  # (``stop`` takes them over)
                raise
            except Exception as exc:  # Redis went away: this batch and the next ones go to the spool
                why = self._why(exc)
                log.warning("ledger write failed (%s); spooling usage records until it is back", why)
                self.degraded = True
                await self._spool_or_keep(batch)
            else:
                self.written += len(batch)
                self._settled(batch)
                self._done(len(batch))

    def _why(self, exc: BaseException) -> str:
        """A failed write's cause for the log. The write's own timeout carries no message: a frozen Redis
        (SIGSTOP, packets dropped) was said as "ledger write failed ()"."""
        if isinstance(exc, TimeoutError) and not str(exc):
            return f"no answer within {self._write_timeout_s:g} s"
        return str(exc) or type(exc).__name__

    async def _degraded_round(self) -> None:
        """While the ledger is away: spool what came (with what the spool refused before), then see whether
        the ledger is back. Records the spool refuses are offered to the ledger directly, so that neither
        one coming back alone leaves them in memory."""
        try:
            async with asyncio.timeout(self._retry_s):
                first = await self._queue.get()
        except TimeoutError:
            batch: list[UsageRecord] = []
        else:
            batch = self._take_batch(first)
        if self._unsaved:
            batch, self._unsaved = [*self._unsaved, *batch], []
        if batch:
            await self._spool_or_keep(batch)
        replayed = await self.replay()
        if await self._write_unsaved() and replayed:
            self.degraded = False
            if self.spool_failing:
                self.spool_failing = False
                log.warning("ledger reachable again; usage records that waited in memory are written")
            else:
                log.warning("ledger reachable again; spool replayed")

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
                if not await self._write_or_spool(owed):
                    self._owed = {r.record_id for r in owed}  # its journal stays until they are safe
                log.warning("billed %d requests an earlier gateway process left unrecorded", len(owed))
            if not self._owed:
                self.journal.forget_replayed()
            self._watch = asyncio.create_task(self._watch_journal(self.journal), name="kvgate-journal")
        self._task = asyncio.create_task(self._run(), name="kvgate-ledger")

    async def _watch_journal(self, journal: UsageJournal) -> None:
        """Every ``retry_s``: a journal whose directory was removed says so, and goes on once it is back
        (``UsageJournal.resume``). On the event loop: the journal is written from it, and these are a few
        syscalls (one ``fstat`` while nothing was removed)."""
        while True:
            await asyncio.sleep(self._retry_s)
            journal.resume()

    async def _write_all(self, records: list[UsageRecord]) -> None:
        """Write ``records`` to the ledger, a batch (one round trip) at a time; raises if it fails."""
        for i in range(0, len(records), MAX_BATCH):
            async with asyncio.timeout(self._write_timeout_s):
                await self.ledger.record_many(records[i : i + MAX_BATCH])

    async def _ledger_took(self, records: list[UsageRecord], what: str) -> bool:
        """``_write_all``, False if the ledger is (still) away: the caller keeps the records."""
        try:
            await self._write_all(records)
        except Exception as exc:  # (not CancelledError: a BaseException, it propagates)
            log.debug("%s failed: %s", what, exc)
            return False
        return True

    async def _write_or_spool(self, records: list[UsageRecord]) -> bool:
        """``records`` to the ledger, else to the spool; False if neither took them, which are then queued
        (the writer offers them to both again)."""
        try:
            await self._write_all(records)
            return True
        except Exception as exc:  # whatever failed, the spool keeps them
            log.warning("ledger write failed (%s); spooling %d records", self._why(exc), len(records))
            self.degraded = True
        try:
            await self._to_spool(records)
            return True
        except Exception as exc:
            self._spool_refused(exc)
        for rec in records:
            self._queue.put_nowait(rec)
        return False

    async def _to_remade_spool(self, records: list[UsageRecord], exc: Exception) -> bool:
        """At the stop, the last resort for records neither the spool nor the ledger took because the
        spool's directory was removed: make it again and spool them, for the next start to replay. While
        running, the operator is asked to restore it; at the stop, the alternative is losing them."""
        if self.spool is None or not isinstance(exc, FileNotFoundError):
            return False
        directory = self.spool.path.parent
        try:
            await asyncio.to_thread(directory.mkdir, mode=0o700, parents=True, exist_ok=True)
            await self._to_spool(records)
        except Exception as again:
            log.debug("could not make the spool's directory %s again: %s", directory, again)
            return False
        log.error(
            "stopping with %d usage records the ledger did not take, and the spool's directory %s had been "
            "removed: made it again and spooled them there, for the next start to replay",
            len(records),
            directory,
        )
        return True

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every submitted record is in the ledger or the spool."""
        async with asyncio.timeout(timeout_s):
            await self._queue.join()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (or spool it), then stop. Nothing submitted is lost."""
        with contextlib.suppress(TimeoutError):
            await self.flush(timeout_s)
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._watch is not None:
            await cancel_and_wait(self._watch)
            self._watch = None
        rest, self._unsaved = self._unsaved, []
        while not self._queue.empty():
            rest.append(self._queue.get_nowait())
        if rest:
            try:
                await self._to_spool(rest)
            except Exception as exc:
                try:
                    await self._write_all(rest)
                    self.written += len(rest)
                    self._settled(rest)
                except Exception:
                    if not await self._to_remade_spool(rest, exc):
                        self._say_unsaved(rest, exc)
        if self.journal is not None:
            self.journal.close()

    def _say_unsaved(self, rest: list[UsageRecord], exc: Exception) -> None:
        """The stop's word on records neither the spool nor the ledger took: where they are, if anywhere."""
        kept = "lost"
        # (Not in a journal whose files were removed: no restart reads those.)
        if self.journal is not None and not self.journal.removed:
            kept = "the journal keeps them for the next start"
            if self.journal.write_failures:  # (less the entries a full disk refused it)
                kept += f" ({self.journal.write_failures} journal entries were refused)"
        what = "stopping with %d usage records neither the spool (%s) nor the ledger took: %s"
        log.error(what, len(rest), exc, kept)


def _free(model: str, prompt: int, cached: int, completion: int) -> int:
    return 0
