"""bench/memory.py's replay of the caching allocator's trace: the peak at or after a given event, the blocks
live then, grouped by the innermost frames of ours."""

import subprocess
import sys

import pytest
import torch

from bench.memory import allocated_at, grouped, live_at_peak

MiB = 2**20


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int) -> dict:
    return {"action": "free_completed", "addr": addr}


GEMM = frame("/x/site-packages/moonep_moe/gemm/torch_native.py", 52, "wgrad")
FUNCTION = frame("/x/site-packages/moonep_moe/layers/function.py", 180, "backward")
TORCH = frame("/x/site-packages/torch/autograd/graph.py", 869, "_engine_run_backward")


def test_allocated_at_names_the_innermost_two_frames_of_ours():
    assert allocated_at([TORCH, GEMM, FUNCTION]) == ("moonep_moe/gemm/torch_native.py:52 wgrad <- "
                                                     "moonep_moe/layers/function.py:180 backward")
    assert allocated_at([TORCH]) == "outside moonep_moe and bench"


def test_the_peak_is_taken_from_the_start_event_on_with_the_blocks_live_then():
    trace = [alloc(1, 500 * MiB, GEMM),  # the build's peak, before the step
             free(1),
             alloc(2, 100 * MiB, FUNCTION),  # the step starts here (event 2)
             alloc(3, 200 * MiB, GEMM),
             alloc(4, 50 * MiB, GEMM),
             free(3),
             alloc(5, 100 * MiB, TORCH),
             free(99)]  # a block from before the trace: skipped
    best, blocks = live_at_peak(trace, start=2)
    assert best == 350 * MiB and sorted(blocks) == [2, 3, 4]
    groups = grouped(blocks)
    assert [(g["where"], g["blocks"]) for g in groups] == [
        ("moonep_moe/gemm/torch_native.py:52 wgrad", 2), ("moonep_moe/layers/function.py:180 backward", 1)]
    assert groups[0]["gib"] == pytest.approx(250 / 1024)
    assert live_at_peak(trace)[0] == 500 * MiB, "from the first event: the build's peak"


def test_cpu_run_names_the_missing_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run")
    run = subprocess.run([sys.executable, "-m", "bench.memory"], capture_output=True, text=True)
    assert run.returncode == 2 and "needs a GPU" in run.stderr


def test_bad_arguments_are_named_before_anything_runs():
    """`--micro-batches` below 1 and a `--config` entry that is not FIELD=VALUE are refused by name (on any
    machine, before the GPU check)."""
    for argv, named in ((["--micro-batches", "0"], "--micro-batches must be at least 1"),
                        (["--config", "precision"], "expected FIELD=VALUE")):
        run = subprocess.run([sys.executable, "-m", "bench.memory", *argv], capture_output=True, text=True)
        assert run.returncode == 2 and named in run.stderr, run.stderr

