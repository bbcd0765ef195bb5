"""The usage journal: what a gateway that died owes the ledger, and a journal that stays about the requests
in flight."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cache.journal import INTERRUPTED, Dispatched, JournalLocked, UsageJournal
from cache.ledger import UsageRecord


def cost(model: str, prompt: int, cached: int, completion: int) -> int:
    return prompt * 10 + completion * 100


def opened(i: int, prompt: int = 50) -> Dispatched:
    return Dispatched(f"r{i}", "acme", "m", "key1", "eu-west", "eu-west/e0", f"req-{i}", prompt, 16, 1.7e9)


def final(i: int, completion: int = 7) -> UsageRecord:
    return UsageRecord(f"r{i}", "acme", "m", 50, 16, completion, cost("m", 50, 16, completion))


def die(journal: UsageJournal) -> None:
    """What the kernel does for a process killed with -9: its files close, nothing else happens."""
    for fd in (journal._fd, journal._lock_fd):
        if fd is not None:
            os.close(fd)


def restart(base: Path) -> list[UsageRecord]:
    journal = UsageJournal(base)
    owed = journal.start(cost)
    journal.forget_replayed()
    journal.close()
    return owed


def test_a_dead_gateway_owes_its_finished_and_its_interrupted_requests(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "gw.spool")
    assert journal.start(cost) == []
    answered = final(1)
    journal.opened(opened(1))  # answered, record not yet in the ledger
    journal.finished(answered)
    journal.opened(opened(2))  # a stream, 12 tokens in when the process died
    journal.progressed("r2", 5)
    journal.progressed("r2", 12)
    journal.opened(opened(3))  # its engine failed before answering: nothing to bill
    journal.voided("r3")
    journal.opened(opened(4))  # failed over: voided on one engine, opened again on the next
    journal.voided("r4")
    journal.opened(opened(4, prompt=60))
    journal.opened(opened(5))  # written to the ledger already: replaying it is harmless (ids count once)
    journal.finished(final(5))
    journal.settled(["r5"])
    die(journal)
    owed = {r.record_id: r for r in restart(tmp_path / "gw.spool")}
    assert set(owed) == {"r1", "r2", "r4", "r5"}
    assert owed["r1"] == answered  # the very record, its time included (the ledger's seen-set is per day)
    assert owed["r2"].status == INTERRUPTED and owed["r2"].estimated
    assert (owed["r2"].prompt_tokens, owed["r2"].completion_tokens) == (50, 12)
    assert owed["r2"].cost_picodollars == cost("m", 50, 16, 12)
    assert (owed["r2"].key_id, owed["r2"].engine, owed["r2"].request_id, owed["r2"].ts) == (
        "key1",
        "eu-west/e0",
        "req-2",
        1.7e9,  # the time of its dispatch: replayed twice, it is the same record (and the same ledger day)
    )
    assert owed["r4"].prompt_tokens == 60 and owed["r4"].completion_tokens == 0
    assert restart(tmp_path / "gw.spool") == []  # once replayed, owed no more


def test_a_torn_last_entry_loses_only_itself(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "gw.spool")
    journal.start(cost)
    journal.opened(opened(1))
    journal.finished(final(1))
    journal.opened(opened(2))
    die(journal)
    [segment] = list(tmp_path.glob("gw.spool.journal.0*"))
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the crash cut r2's open short
    assert [r.record_id for r in restart(tmp_path / "gw.spool")] == ["r1"]


def test_segments_go_once_their_requests_are_settled_and_never_out_of_order(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "gw.spool", segment_bytes=600)
    journal.start(cost)
    segments = lambda: sorted(p.name for p in tmp_path.glob("gw.spool.journal.0*"))  # noqa: E731
    journal.opened(opened(1))  # r1 stays open: its segment must stay, and so must every later one
    for i in range(2, 12):
        journal.opened(opened(i))
        journal.finished(final(i))
        journal.settled([f"r{i}"])
    kept = segments()
    assert len(kept) > 2
    for path in tmp_path.glob("gw.spool.journal.0*"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    journal.voided("r1")
    assert len(segments()) == 1  # only the one being written
    journal.close()
    assert segments() == [] and not list(tmp_path.iterdir())  # nothing owed: nothing left behind


def test_the_journal_is_bounded_by_the_requests_in_flight(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "gw.spool", segment_bytes=4096)
    journal.start(cost)
    for i in range(5000):
        journal.opened(opened(i))
        journal.finished(final(i))
        journal.settled([f"r{i}"])
    size = sum(p.stat().st_size for p in tmp_path.glob("gw.spool.journal.0*"))
    assert size <= 2 * 4096 and journal.pending == 0


def test_two_processes_cannot_share_a_journal(tmp_path: Path) -> None:
    first = UsageJournal(tmp_path / "gw.spool")
    first.start(cost)
    with pytest.raises(JournalLocked, match="spool_path of its own"):
        UsageJournal(tmp_path / "gw.spool").start(cost)
    first.close()
    UsageJournal(tmp_path / "gw.spool").start(cost)  # free again once the first is closed


def test_a_journal_whose_directory_was_removed_goes_on_once_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It wrote on into its deleted segment until a restart: entries no replay would find."""
    directory = tmp_path / "state"
    journal = UsageJournal(directory / "gw.spool")
    journal.start(cost)
    journal.opened(opened(1))
    shutil.rmtree(directory)
    with caplog.at_level(logging.ERROR, "kvgate.journal"):
        # (Not made by the journal: restored by the operator.)
        assert journal.removed and not journal.resume() and not journal.resume()
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [
        f"the usage journal's directory {directory} was removed"  # (said once, not at each try)
    ]
    journal.opened(opened(2))  # lost with the segment, as before
    directory.mkdir()
    intruder = UsageJournal(directory / "gw.spool")  # a second gateway took the free name first
    intruder.start(cost)
    caplog.clear()
    with caplog.at_level(logging.ERROR, "kvgate.journal"):
        assert not journal.resume() and not journal.resume() and journal.removed
    assert len(caplog.records) == 1  # (said once, not at each try)
    intruder.close()
    (directory / "gw.spool.journal.00000007").write_bytes(b"")  # a restored copy's segment, say
    assert journal.resume() and not journal.removed
    assert journal._segment == 8  # after what the directory holds
    journal.finished(final(1))  # started before, finished after: its record is kept
    journal.opened(opened(3))
    journal.progressed("r3", 4)
    with pytest.raises(JournalLocked):  # it holds the new lock
        UsageJournal(directory / "gw.spool").start(cost)
    die(journal)
    owed = {r.record_id: r for r in restart(directory / "gw.spool")}
    assert set(owed) == {"r1", "r3"} and owed["r3"].completion_tokens == 4


# -- a disk that refuses writes: the journal is crash insurance, it must never fail a request ---------------


def full_disk_under(journal: UsageJournal) -> int:
    """Point the journal's open segment at /dev/full (every write: ENOSPC); returns the real segment's fd."""
    assert journal._fd is not None
    saved = os.dup(journal._fd)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, journal._fd)
    os.close(full)
    return saved


def disk_back_under(journal: UsageJournal, saved: int) -> None:
    assert journal._fd is not None
    os.dup2(saved, journal._fd)
    os.close(saved)


def test_a_full_disk_costs_the_journal_entries_not_the_request(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "gw.spool")
    journal.start(cost)
    journal.opened(opened(1))
    saved = full_disk_under(journal)
    journal.opened(opened(2))  # must not raise: the request it belongs to goes on
    journal.finished(final(2))
    journal.voided("r1")
    assert journal.failing and journal.write_failures == 3
    assert journal.pending == 0  # r1 voided (settled at once), r2 has no entry on disk
    disk_back_under(journal, saved)
    journal.opened(opened(3))
    journal.finished(final(3))
    assert not journal.failing and journal.write_failures == 3
    die(journal)
    # r1's ``open`` is on disk without its ``void`` (refused): a crash now would bill its prompt as
    # interrupted — the estimate the journal makes of any request whose end it did not see.
    assert [(r.record_id, r.status) for r in restart(tmp_path / "gw.spool")] == [
        ("r1", INTERRUPTED),
        ("r3", "completed"),
    ]


def test_an_entry_the_disk_took_only_part_of_is_cut_so_later_entries_stay_readable(tmp_path: Path) -> None:
    """A file-size limit (RLIMIT_FSIZE) makes the kernel take only the first bytes of a write, as a disk
    that fills mid-write does: the torn bytes must not stay in front of the entries that follow."""
    script = f"""
import os, resource, signal
from pathlib import Path
from tests.cache.test_journal import cost, die, final, opened
from cache.journal import UsageJournal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
journal = UsageJournal(Path({str(tmp_path)!r}) / "gw.spool")
journal.start(cost)
journal.opened(opened(1))
journal.finished(final(1))
limit = os.fstat(journal._fd).st_size + 9
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
journal.opened(opened(2))  # the kernel takes 9 bytes of it
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
journal.opened(opened(3))
journal.finished(final(3))
die(journal)
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    owed = restart(tmp_path / "gw.spool")
    assert [(r.record_id, r.status) for r in owed] == [("r1", "completed"), ("r3", "completed")]


def test_a_segment_that_cannot_be_opened_keeps_the_journal_on_the_one_it_has(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path / "gw.spool", segment_bytes=600)
    journal.start(cost)
    (tmp_path / "gw.spool.journal.00000001").mkdir()  # where the next segment would go: EISDIR
    for i in range(1, 9):  # well past 600 bytes
        journal.opened(opened(i))
        journal.finished(final(i))
    assert not journal.failing and journal.write_failures == 0  # every entry is on disk, in segment 0
    assert (tmp_path / "gw.spool.journal.00000000").stat().st_size > 600
    (tmp_path / "gw.spool.journal.00000001").rmdir()
    journal.opened(opened(9))  # rolls over now
    journal.finished(final(9))
    assert (tmp_path / "gw.spool.journal.00000001").is_file()
    die(journal)
    assert [r.record_id for r in restart(tmp_path / "gw.spool")] == [f"r{i}" for i in range(1, 10)]
