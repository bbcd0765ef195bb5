"""A gateway's own count of an engine's prefill queue: the uncached prompt tokens it sent there whose first
token has not come back, and how far the engine is likely to be through them.

Between health polls this count is all the router knows of an engine's queue. A prompt's tokens leave it
when its first token comes back; until then the engine works through the oldest of them at about the
configured prefill speed, and the estimate says so: without that, a long prompt weighs in full until its
first token, and a request arriving near the end of its prefill sees seconds of queue where milliseconds
are left.

It also says which prefixes are not computed yet. An engine announces a prompt's blocks when it schedules
them (vLLM's KV events do, and kvgate's), so until the first token a peer that pulls them would find only
part of them: each entry remembers where its prompt's uncomputed blocks begin, and
:meth:`PrefillQueue.computed_blocks` stops a pullable prefix there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class QueuedPrefill:
    """One request's uncached prompt tokens in the queue (what :meth:`PrefillQueue.settle` takes back), and
    where they begin in its chain of block hashes: block ``first_block`` (hash ``first_hash``) and the
    blocks after it are not computed until it settles."""

    __slots__ = ("first_block", "first_hash", "tokens")

    def __init__(self, tokens: int, first_block: int = -1, first_hash: int = 0) -> None:
        self.tokens = tokens
        self.first_block = first_block  # (-1: not known, e.g. a prompt shorter than one block)
        self.first_hash = first_hash


class PrefillQueue:
    """The prefills this gateway sent one engine, oldest first, with their total."""

    __slots__ = ("_entries", "_since", "tokens")

    def __init__(self) -> None:
        self._entries: deque[QueuedPrefill] = deque()
        self._since = 0.0  # (monotonic) when the engine began on the oldest, as far as this gateway knows
        self.tokens = 0  # the entries' total

    def add(
        self, tokens: int, now: float, chain: Sequence[int] = (), first_block: int = 0
    ) -> QueuedPrefill | None:
        """``tokens`` of prefill sent at ``now`` (monotonic), queued behind the others; the entry to pass to
        :meth:`settle` (None for nothing to compute). ``chain`` is the prompt's block hashes in the
        engine's blocks, of which those from ``first_block`` on are to be computed."""
        if tokens <= 0:
            return None
        if 0 <= first_block < len(chain):
            entry = QueuedPrefill(tokens, first_block, chain[first_block])
        else:
            entry = QueuedPrefill(tokens)
        if not self._entries:
            self._since = now
        self._entries.append(entry)
        self.tokens += tokens
        return entry

    def settle(self, entry: QueuedPrefill, now: float) -> None:
        """``entry``'s prefill is done (its first tokens flow) or will never run. Prefills run first come,
        first served: when it was the oldest, the engine is on the next one from ``now``."""
        entries = self._entries
        if entries and entries[0] is entry:
            entries.popleft()
            self._since = now
        else:
            try:
                entries.remove(entry)
            except ValueError:
                return  # (settled already)
        self.tokens -= entry.tokens

    def estimate(self, now: float, s_per_token: float) -> int:
        """Tokens still queued at ``now``: the total, less what the engine has had time to compute of the
        oldest since it began on it (at ``s_per_token``; 0: no drain). Only the oldest drains: a speed set
        too fast then errs by one prompt at most, and its first token puts the count right."""
        entries = self._entries
        if not entries or s_per_token <= 0:
            return self.tokens
        return self.tokens - min(entries[0].tokens, int((now - self._since) / s_per_token))

    def computed_blocks(self, chain: Sequence[int], blocks: int) -> int:
        """Of the first ``blocks`` of a prompt's ``chain`` (block hashes in the engine's blocks, which the
        engine announced), how many no queued prompt is still computing: what a peer can pull from it now.
        A chain's hash names its whole prefix, so one comparison per queued prompt finds a shared one."""
        for entry in self._entries:
            at = entry.first_block
            if 0 <= at < min(blocks, len(chain)) and chain[at] == entry.first_hash:
                blocks = at
        return blocks
