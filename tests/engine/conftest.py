"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.compress import codec


@pytest.fixture
def numpy_path() -> Iterator[None]:
    """The compression codec's numpy reference instead of the native extension, for one test."""
    codec.use_native(False)
    try:
        yield
    finally:
        codec.use_native(True)
