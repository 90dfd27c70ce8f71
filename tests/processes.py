"""Spawning test ranks as processes: shared by the multi-process tests (collective and symmetric worlds).

Ranks start from multiprocessing's fork server with torch preloaded: the server is a fresh interpreter that
imports torch once (and nothing else: neither the package nor the test process's state), and each rank is
forked from it, so a rank starts as a spawned one would after `import torch`, without importing torch again
(seconds of CPU per rank, most of a small run's time on a 2-core machine). Importing torch initialises no
CUDA context, so the ranks create theirs as spawned ones do.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch


def spawn_ranks(rank_main: Callable, job: Callable, size: int, folder: Path, timeout_s: float,
                dying: Collection[int] = ()) -> list[dict | None]:
    """`rank_main(job, rank, size, str(folder))` on `size` spawned processes, each saving its result dict to
    `folder/rank{rank}.pt` (`{"error": traceback}` on failure); the results in rank order. Fails on a rank
    still running after `timeout_s` (all such are killed), a rank that died without a result, or any error.
    The ranks in `dying` must instead exit with a non-zero code and no result (their entries are None)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])  # read when the server starts: the first call of a session
    processes = [context.Process(target=rank_main, args=(job, r, size, str(folder))) for r in range(size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.1))
    hung = [r for r, process in enumerate(processes) if process.is_alive()]
    for r in hung:
        processes[r].kill()
    assert not hung, f"ranks {hung} still running after {timeout_s} s"
    codes = [p.exitcode for p in processes]
    results = [torch.load(folder / f"rank{r}.pt", weights_only=False) if (folder / f"rank{r}.pt").exists()
               else None for r in range(size)]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if res and "error" in res]
    assert not errors, "\n".join(errors)
    unexpected = [r for r in range(size) if (results[r] is None) != (r in dying)]
    assert not unexpected and all(codes[r] != 0 for r in dying), \
        f"ranks {list(dying)} should die without a result, the others save one: exit codes {codes}, " \
        f"results from ranks {[r for r in range(size) if results[r] is not None]}"
    return results
