"""Whether this process runs Triton kernels in Triton's CPU interpreter (`TRITON_INTERPRET=1`), decided the
way `triton.jit` decides it for every kernel: when a kernel is decorated, here at import. The CPU tests run
the kernels that way; compiled kernels pick their GPU tiles and hardware conversions where it is False."""

from __future__ import annotations

import contextlib
import threading

import triton
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


INTERPRETED = isinstance(_probe, InterpretedFunction)
"""True where `triton.jit` gives interpreted functions: the kernels run on CPU tensors."""


_lock = threading.Lock()


def launching() -> contextlib.AbstractContextManager:
    """Held around a kernel launch: the interpreter keeps its program ids and language patches in globals, so
    thread-ranks interpreting kernels at once take turns; compiled launches need nothing."""
    return _lock if INTERPRETED else contextlib.nullcontext()
