"""Shared test settings."""

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so CI checks every kernel
# against its reference too (small shapes); the flag must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Thread-ranks run R Python threads on a 2-core CI machine: nested intra-op OpenMP threads only
# oversubscribe it (and make timings erratic), so every op runs single-threaded.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked `@pytest.mark.gpu` skip, with a reason, where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
