"""Shared test settings."""

import os

import pytest
import torch
from stress import ENV, install_from_env

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so CI checks every kernel
# against its reference too (small shapes); the flag must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Thread-ranks run R Python threads on a 2-core CI machine: nested intra-op OpenMP threads only
# oversubscribe it (and make timings erratic), so every op runs single-threaded.
torch.set_num_threads(1)

# MOONEP_STRESS=1: every comm operation first delays a stream (tests/stress.py), so a missing wait between
# streams or thread-ranks fails every time on a GPU; off CUDA it changes nothing.
STRESS = install_from_env()


def pytest_report_header(config):
    if STRESS is not None:
        return f"{ENV}: every comm operation delays a stream by {STRESS.cycles} cycles (tests/stress.py)"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, with a reason, where there is no CUDA device; tests marked `interpreter`
    (Triton kernels on CPU tensors) skip where there is one: there the kernels are compiled, and the `gpu`
    tests check them on CUDA tensors."""
    cuda = torch.cuda.is_available()
    skips = {"gpu": pytest.mark.skip(reason="needs a CUDA device (run on the H200)"),
             "interpreter": pytest.mark.skip(reason="Triton's interpreter runs only where there is no GPU; "
                                                     "the gpu-marked tests cover the compiled kernels")}
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords and (marker == "gpu") != cuda:
                item.add_marker(skip)
