"""A local append-only spool for ledger records that could not reach Redis: msgpack, one fsync per record.

A crash can at worst cut the last record short; reading stops there, and the next process to open the spool
cuts that tail off before it appends (records appended after it would otherwise be read as its rest, and
lost). Replaying is safe to repeat, since the ledger counts a record id once.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack

from cache.ledger import UsageRecord


class Spool:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tail_checked = False  # whether this process looked for a torn tail before its first append

    def _cut_torn_tail(self) -> None:
        """Truncate the spool after its last whole record (a predecessor's crash may have torn the next)."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(data)
        whole = 0
        try:
            for _ in unpacker:
                whole = unpacker.tell()
        except (ValueError, TypeError, msgpack.UnpackException):
            pass
        if whole < len(data):
            os.truncate(self.path, whole)

    def append(self, records: list[UsageRecord]) -> None:
        """Durably add ``records`` (blocking: call it off the event loop)."""
        if not self._tail_checked:
            self._cut_torn_tail()
            self._tail_checked = True
        data = b"".join(msgpack.packb(r.to_dict()) for r in records)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            size = os.fstat(fd).st_size
            try:
                write_all(fd, data)
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, size)  # (a full disk, say): no torn record for the next append to follow
                raise
        finally:
            os.close(fd)

    def read(self) -> list[UsageRecord]:
        if not self.path.exists():
            return []
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(self.path.read_bytes())
        out = []
        try:
            for raw in unpacker:
                if isinstance(raw, dict):
                    out.append(UsageRecord.from_dict(raw))
        except (ValueError, TypeError, msgpack.UnpackException):
            pass  # a record cut short by a crash: everything before it is intact
        return out

    def __len__(self) -> int:
        return len(self.read())

    def clear(self, count: int) -> None:
        """Drop the first ``count`` records (those just replayed), keeping any appended since."""
        rest = self.read()[count:]
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        # Created 0600 like the spool itself (billing records are nobody else's to read), whatever the umask.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a .tmp left by a crash keeps its old mode through O_CREAT
            write_all(fd, b"".join(msgpack.packb(r.to_dict()) for r in rest))
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(self.path)


def write_all(fd: int, data: bytes) -> None:
    """``write(2)`` until all of ``data`` is written (one call may write less: a signal, a full disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
