"""A write-ahead journal of billable requests, so that a gateway that dies (``kill -9``, a crash, the OOM
killer) still bills what its engines did.

Each request an engine accepts leaves entries in an append-only local file, each one ``os.write`` call
(no fsync: a process that dies loses nothing the kernel already holds, and a machine that dies takes the
gateway's in-memory ledger queue with it either way):

- ``open``: at dispatch, the record the request would get if nothing more were known (its prompt, the cache
  the router predicted, no completion tokens);
- ``progress``: now and then while a stream runs, the completion tokens sent so far;
- ``final``: the request's real usage record, written *before* the last byte of its answer leaves;
- ``void``: nothing is billable (the engine failed before answering; another engine may take it over).

A gateway that starts replays the journal it finds: a ``final`` is written to the ledger again (the ledger
counts a record id once), an ``open`` with no end becomes an estimated record (status ``interrupted``) with
the last ``progress``. The file is cut into segments; a segment is deleted once every request with an entry
in it (and in every older segment) is in the ledger or its spool, so the journal holds about the requests in
flight. One process at a time may use a journal (an exclusive lock beside it).

A disk that refuses a write (full, failing) costs the journal that entry, never the request: the bytes of a
write the disk took only part of are cut off again (so the entries after it stay readable), the failure is
counted and logged once, and the next entry tries again. The ledger still gets every record; what a refused
entry loses is only the crash insurance of its request. A segment that cannot be opened keeps the journal
on the segment it has until one can.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

from cache.ledger import UsageRecord
from cache.spool import write_all

log = logging.getLogger("kvgate.journal")

SEGMENT_BYTES = 1 << 20  # about 2,000 requests a segment
INTERRUPTED = "interrupted"  # the status of a record rebuilt from an ``open`` entry

_OPEN, _PROGRESS, _FINAL, _VOID = "o", "p", "f", "v"

# (model, prompt tokens, cached tokens, completion tokens) -> pico-dollars, at today's prices
CostFn = Callable[[str, int, int, int], int]


class Dispatched(NamedTuple):
    """An ``open`` entry: a request as it leaves for an engine (positional on disk: one per request)."""

    record_id: str
    tenant: str
    model: str
    key_id: str
    region: str
    engine: str
    request_id: str
    prompt_tokens: int
    cached_tokens: int  # as the router predicted
    ts: float

    def estimate(self, completion_tokens: int, cost: CostFn) -> UsageRecord:
        """Its record when all that is known is this and the completion tokens last noted."""
        return UsageRecord(
            record_id=self.record_id,
            tenant=self.tenant,
            model=self.model,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=completion_tokens,
            cost_picodollars=cost(self.model, self.prompt_tokens, self.cached_tokens, completion_tokens),
            status=INTERRUPTED,
            key_id=self.key_id,
            region=self.region,
            engine=self.engine,
            request_id=self.request_id,
            estimated=True,
            ts=self.ts,
        )


class JournalLocked(RuntimeError):
    """Another process holds this journal: two gateways must not share a spool path."""


class UsageJournal:
    def __init__(self, base: str | Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        base = Path(base)
        self.directory = base.parent
        self._stem = base.name + ".journal."
        self._lock_path = self.directory / (self._stem + "lock")
        self._segment_bytes = segment_bytes
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._segment = 0
        self._written = 0
        self._pending: dict[str, list[int]] = {}  # record id -> segments it has entries in, while unsettled
        self._unsettled: dict[int, int] = {}  # segment -> requests with an entry in it not yet settled
        self._rolling_failed = False  # the next segment could not be opened: said once, tried every entry
        self._removal_said = False  # its directory's removal was logged (once per removal)
        self._resume_refused = ""  # why the last ``resume`` failed (said once)
        self.entries = 0
        self.failing = False  # the last entry was refused by the disk
        self.write_failures = 0  # entries the disk refused, ever

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self, cost: CostFn) -> list[UsageRecord]:
        """Lock the journal and read what an earlier process left: the records it owes the ledger. Those
        segments stay until ``forget_replayed`` (call it once the records are in the ledger or the spool)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        self._replayed = self._segments()
        records = owed_records(self._read(self._replayed), cost)
        self._segment = (self._replayed[-1] + 1) if self._replayed else 0
        self._open_segment()
        return records

    def _take_lock(self) -> int:
        """The journal's lock, held for the process's life; JournalLocked if another process holds it."""
        while True:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise JournalLocked(locked_message(self._lock_path, holder)) from None
            try:
                if os.stat(self._lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the lock file was removed by a process closing meanwhile: lock the new one
        with contextlib.suppress(OSError):  # (who holds it, for the message of a process refused it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def resume(self) -> bool:
        """Go on in a new segment once the directory of a ``removed`` journal exists again (the operator
        restored it), under a new lock; True when it did. It is not made here, as the spool's is not: a
        directory that vanished is the operator's to restore (or to mount again). The requests in flight
        when it was removed have their first entries in the lost segment only: a crash before they finish
        loses them, as it would have; what they write from now on is kept. Meant to be called now and then
        (the ledger writer does, every second): the removal is said at the first call that sees it."""
        if not self.removed:
            return False
        if not self._removal_said:
            self._removal_said = True
            log.error(
                "the usage journal's directory %s was removed: a crash now would lose the records of the "
                "requests in flight; make the directory again and the journal goes on there",
                self.directory,
            )
        if not self.directory.is_dir():
            return False
        try:
            lock_fd = self._take_lock()
        except (OSError, JournalLocked) as exc:
            self._cannot_resume(f"cannot take the usage journal's lock in {self.directory} again: {exc}")
            return False
        try:
            # After any segment a restored copy of the directory holds: a replay reads them in order.
            segment = max([self._segment, *self._segments()]) + 1
            fd = os.open(self._path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            os.close(lock_fd)
            self._cannot_resume(f"cannot write the usage journal in {self.directory} again: {exc}")
            return False
        self._removal_said, self._resume_refused = False, ""
        assert self._fd is not None
        os.close(self._fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd, self._segment = lock_fd, segment
        self._use_segment(fd)
        log.warning(
            "the usage journal's directory %s is back: the journal is written there again (requests "
            "started before it was restored are billed when they finish, but not after a crash)",
            self.directory,
        )
        return True

    def _cannot_resume(self, why: str) -> None:
        """Said when the reason changes, not at every try (the gateway tries every second)."""
        if why != self._resume_refused:
            self._resume_refused = why
            log.error("%s", why)

    def forget_replayed(self) -> None:
        """The records ``start`` returned are safe elsewhere: drop the segments they came from."""
        for segment in self._replayed:
            if not self._remove(segment):
                break
        self._replayed = []

    def close(self) -> None:
        """Stop writing; with nothing unsettled the journal is removed, else it stays for the next start."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._pending:
            for segment in self._segments():
                if not self._remove(segment):
                    break
        if self._lock_fd is not None:
            if not self._pending:  # (removed while still locked: a process that opened it re-checks)
                with contextlib.suppress(OSError):
                    self._lock_path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- entries (each one write; never raise into the request path) ----------------------------------------

    def opened(self, request: Dispatched) -> None:
        """An engine is about to get the request: what it costs if nothing more is heard is its prompt."""
        self._append(request.record_id, (_OPEN, *request))

    def progressed(self, record_id: str, completion_tokens: int) -> None:
        self._append(record_id, [_PROGRESS, record_id, completion_tokens])

    def finished(self, record: UsageRecord) -> None:
        # asdict, not vars(): a record compiled by mypyc (gateway.compiled) has no __dict__.
        self._append(record.record_id, [_FINAL, record.record_id, asdict(record)])

    def voided(self, record_id: str) -> None:
        """Nothing of the request is billable; it is settled at once."""
        self._append(record_id, [_VOID, record_id])
        self.settled([record_id])

    def settled(self, record_ids: Iterable[str]) -> None:
        """These requests' records are in the ledger or the spool: their entries are no longer needed."""
        emptied = False
        for record_id in record_ids:
            for segment in self._pending.pop(record_id, ()):
                self._unsettled[segment] -= 1
                emptied = emptied or (self._unsettled[segment] == 0 and segment != self._segment)
        if emptied:
            self._drop_settled_segments()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def removed(self) -> bool:
        """Whether the segment being written has lost its name (its directory was removed): entries still
        land, in a file no restart will find, so a crash would lose the requests in flight."""
        if self._fd is None:
            return False
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return False

    # -- files ----------------------------------------------------------------------------------------

    def _append(self, record_id: str, entry: list[Any] | tuple[Any, ...]) -> None:
        if self._fd is None:
            return
        data = msgpack.packb(entry)
        try:
            write_all(self._fd, data)  # (a part the disk took before refusing the rest is cut off again)
        except OSError as exc:
            self._refused(exc)
            return
        if self.failing:
            self.failing = False
            log.warning("the usage journal takes writes again")
        self.entries += 1
        self._written += len(data)
        segments = self._pending.setdefault(record_id, [])
        if not segments or segments[-1] != self._segment:
            segments.append(self._segment)
            self._unsettled[self._segment] = self._unsettled.get(self._segment, 0) + 1
        if self._written >= self._segment_bytes:
            self._roll_over()

    def _refused(self, exc: OSError) -> None:
        """An entry the disk refused: cut whatever part of it landed, so that the next entry starts where a
        replay expects one, and say so once per episode."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._written)
        self.write_failures += 1
        if not self.failing:
            self.failing = True
            log.error(
                "cannot write the usage journal in %s (%s): requests are served and billed, but a crash "
                "now would lose the records of those in flight; free the disk",
                self.directory,
                exc,
            )

    def _roll_over(self) -> None:
        """Go on in a new segment; if it cannot be opened, stay on this one (it grows) and try again at the
        next entry."""
        try:
            fd = os.open(self._path(self._segment + 1), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            if not self._rolling_failed:
                self._rolling_failed = True
                log.error("cannot open a new usage journal segment (%s): the current one grows", exc)
            return
        self._rolling_failed = False
        assert self._fd is not None
        os.close(self._fd)
        self._segment += 1
        self._use_segment(fd)
        self._drop_settled_segments()

    def _open_segment(self) -> None:
        self._use_segment(os.open(self._path(self._segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))

    def _use_segment(self, fd: int) -> None:
        self._fd = fd
        self._written = os.fstat(fd).st_size
        self._unsettled.setdefault(self._segment, 0)

    def _drop_settled_segments(self) -> None:
        """Delete the oldest segments, in order, while none of their requests is unsettled (an older segment
        must never outlive a newer one: a replay would then see an ``open`` without its ``void``)."""
        for segment in sorted(self._unsettled):  # (a handful: the segments of the requests in flight)
            if segment == self._segment or self._unsettled[segment] > 0:
                return
            if not self._remove(segment):
                return  # (tried again at the next drop)
            del self._unsettled[segment]

    def _remove(self, segment: int) -> bool:
        """Delete a segment; False if it cannot be (a read-only or vanished directory). A segment left over
        is harmless, as long as no newer one goes before it (the caller stops there): the next start replays
        it, and the ledger counts each record id once. Raising would stop the ledger writer, which settles."""
        try:
            self._path(segment).unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    def _path(self, segment: int) -> Path:
        return self.directory / f"{self._stem}{segment:08d}"

    def _segments(self) -> list[int]:
        found = []
        for path in self.directory.glob(self._stem + "*"):
            suffix = path.name[len(self._stem) :]
            if suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    def _read(self, segments: list[int]) -> list[list[Any]]:
        entries: list[list[Any]] = []
        for segment in segments:
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(self._path(segment).read_bytes())
            with contextlib.suppress(ValueError, TypeError, msgpack.UnpackException):
                entries.extend(e for e in unpacker if isinstance(e, list) and len(e) >= 2)
            # (an entry cut short by the crash ends the segment: everything before it is whole)
        return entries


def journal_holder(base: str | Path) -> int | None:
    """Whether another process holds the journal of the spool ``base``: its pid (0 when it did not say),
    or None when it is free. Checks without keeping the lock."""
    base = Path(base)
    try:
        fd = os.open(base.parent / (base.name + ".journal.lock"), os.O_RDONLY)
    except OSError:  # (no lock file: nobody holds it)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # (which releases a lock it took)
    return None


def locked_message(lock_path: Path, holder: int) -> str:
    """Why a journal cannot be had, naming the process that holds it. The usual holder is no second
    gateway but the last ``kvgate serve`` on this spool path, whose workers drain on after it was killed."""
    who = f"process {holder}" if holder else "another process"
    return (
        f"{who} is using the usage journal at {lock_path}: a gateway still stopping (its drain lasts up to "
        "drain_timeout_s), or another one on this spool_path; wait for it to end, or give each gateway (and "
        "each worker) a spool_path of its own"
    )


def _holder(fd: int) -> int:
    """The pid the journal's holder wrote into its lock file; 0 when it is not there."""
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    return 0


def owed_records(entries: Iterable[list[Any]], cost: CostFn) -> list[UsageRecord]:
    """The records a journal's entries owe the ledger, in the order their requests first appear."""
    opened: dict[str, Dispatched] = {}
    state: dict[str, UsageRecord | None] = {}  # record id -> its record (None: void, or only progress seen)
    for entry in entries:
        kind, record_id = entry[0], str(entry[1])
        try:
            if kind == _OPEN:
                opened[record_id] = Dispatched(*entry[1:])
                state[record_id] = opened[record_id].estimate(0, cost)
            elif kind == _PROGRESS and record_id in opened:
                state[record_id] = opened[record_id].estimate(int(entry[2]), cost)
            elif kind == _FINAL:
                state[record_id] = UsageRecord.from_dict(entry[2])
                opened.pop(record_id, None)
            elif kind == _VOID:
                state[record_id] = None
                opened.pop(record_id, None)
        except (TypeError, ValueError, IndexError):
            continue  # an entry this version cannot read: skip it rather than lose the rest
    return [record for record in state.values() if record is not None]
