"""Carries on, inside a task, a coroutine that was started outside any task (as Python 3.12's eager tasks
do): ``gateway.http.lean_http`` checks a cached key without a task, and makes one only when the check
waits."""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any, TypeVar, cast

_T = TypeVar("_T")


class _CarryOn:
    """Awaiting this carries on a coroutine that was started outside any task and stopped at ``awaited``
    (a future it waits on): the task awaiting it takes over from there, as Python 3.12's eager tasks do."""

    __slots__ = ("_awaited", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, _T], awaited: Any) -> None:
        self._coroutine = coroutine
        self._awaited = awaited

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, awaited = self._coroutine, self._awaited
        while True:
            try:
                yield awaited  # the task waits on it as the coroutine would have
            except BaseException as exc:  # a cancellation: delivered where the coroutine waits
                try:
                    awaited = coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    awaited = coroutine.send(None)
                except StopIteration as done:
                    return done.value


async def carry_on(coroutine: Coroutine[Any, Any, _T], awaited: Any) -> _T:
    """Finish ``coroutine``, started outside any task and stopped at ``awaited``, in the running task."""
    return cast(_T, await _CarryOn(coroutine, awaited))
