"""Imported by tests/conftest.py before anything imports the engine: lets tests run kernels in Triton's
interpreter on a machine without a GPU.

Triton decides once, when first imported, whether its own library (``tl.sum``, ``tl.max`` ...) is compiled
or interpreted; our kernels decide at each launch (engine/kernels/triton_support.py). So on a machine
without CUDA, Triton is imported here in interpreter mode and the variable put back as it was: the engine
keeps its torch path on CPU, and a test opts in with ``TRITON_INTERPRET=1`` (monkeypatch.setenv).
On a GPU machine nothing changes: kernels compile, and the interpreter tests skip.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # the tests that need Triton skip
        pass
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
