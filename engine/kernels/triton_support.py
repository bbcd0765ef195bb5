"""Triton when it is installed, a stand-in when it is not, and kernels jitted at their first launch.

A kernel module's signatures name ``tl.constexpr``, so they must evaluate without Triton (macOS, Windows):
``tl`` is then a stand-in that only provides that name. Kernels are jitted lazily, once per mode, because
Triton decides between compiling and interpreting (``TRITON_INTERPRET=1``) when ``triton.jit`` runs: a test
that sets the variable after the engine was imported still gets interpreted kernels.

Kernel bodies carry no Python type hints on their parameters: Triton reads annotations as Triton types.
"""

from collections.abc import Callable
from typing import Any

__all__ = [
    "HAVE_TRITON",
    "LazyKernel",
    "interpreter_usable",
    "interpreting",
    "kernel",
    "next_power_of_2",
    "tl",
]

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships wherever torch's CUDA build does
    HAVE_TRITON = False

    class _NoTritonLanguage:
        constexpr = object

    tl = _NoTritonLanguage()


def interpreter_usable() -> bool:
    """Whether launches can be interpreted: Triton's own library must have been imported in interpreter
    mode too (it decides once, at import), else it is compiled code the interpreter cannot call."""
    return HAVE_TRITON and not isinstance(tl.standard.cdiv, triton.runtime.JITFunction)


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``), read at each call."""
    return HAVE_TRITON and bool(triton.knobs.runtime.interpret)


class LazyKernel:
    """``kernel[grid](*args)`` like a ``triton.jit`` function, jitted at first launch in the current mode."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if not HAVE_TRITON:
            raise RuntimeError(f"kernel {self.fn.__name__} needs Triton, which is not installed")
        mode = interpreting()
        if mode and not interpreter_usable():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after Triton was imported: set it before the first import"
            )
        jitted = self._jitted.get(mode)
        if jitted is None:
            jitted = self._jitted[mode] = triton.jit(self.fn)
        return jitted[grid]  # type: ignore[no-any-return]


def kernel(fn: Callable[..., None]) -> LazyKernel:
    """Decorator for a Triton kernel body (no ``from __future__ import annotations`` in its module: the
    interpreter recognises ``tl.constexpr`` parameters only as real annotations, not as strings)."""
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
