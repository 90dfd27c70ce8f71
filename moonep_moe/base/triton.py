"""Whether Triton can run here: the one check every backend and kernel choice asks. Importing this module
does not import Triton (importing the package must not); the first question does, once."""

from __future__ import annotations

import functools


@functools.cache
def triton_missing_reason() -> str | None:
    """Why Triton's kernels cannot run in this process (it does not import), or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton cannot be imported ({error})"
    return None


def triton_available() -> bool:
    """Whether Triton imports here: the kernels then run on CUDA, and on the CPU in its interpreter."""
    return triton_missing_reason() is None


def triton_version() -> str:
    """The installed Triton's version, "none" without it."""
    if not triton_available():
        return "none"
    import triton

    return triton.__version__
