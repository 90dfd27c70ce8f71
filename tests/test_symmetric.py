"""The symmetric-memory EP world with real processes: 2 and 4 processes sharing the one GPU.

Each process is one EP rank with a `SymmetricWorld` over a gloo group (file store) and
`TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`, so the real rendezvous, peer mappings, peer loads and stores
and device barriers run on a one-GPU machine. Every result is checked against a plain reference computed
here and against the same computation on the threads world in this process (on the CPU):
the all-gather, row scatters and gathers (uniform and skewed, tight and default capacity), barriers reused
over many phases (eagerly and replayed from a CUDA graph), an exchange without host syncs, a Buffer step
(dispatch, combine, prefetch_weight, reduce_grad; integer-valued float64, so exact) and a MoonEPMoELayer
forward + backward (fp32 with skewed routing; float64 with padding), plus the construction errors.

Spawning is slow (each process imports torch and creates a CUDA context), so one spawned run per group size
carries every check, in a module-scoped fixture; results come back through files. Every wait is bounded:
the barriers trap on the device after `TIMEOUT_S`, the process group times out, and the run is killed after
`RUN_TIMEOUT_S`. `spawn_symmetric(job, size, folder)` is the reusable part: any `job(world) -> dict` of
CPU tensors and strings, run on `size` ranks of one GPU.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import spawn_ranks
from stress import install_from_env
from test_buffer import DOWN_NK, GATE_NK, Case, dispatch, full_weights
from test_layer import TOL, make_config, make_problem, rank_step, run_moonep

import moonep_moe.transport.symmetric as symmetric_module
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.arena import PhysicalRows
from moonep_moe.transport.peer import entries_by_rank, write_peer_rows
from moonep_moe.transport.symmetric import NO_MULTICAST_ENV, SymmetricWorld, init_symmetric
from moonep_moe.transport.threads import run_ranks
from moonep_moe.weights.pool import ExpertRows, slot_grad_pool, slot_pool

TIMEOUT_S = 60.0
"""The process group's and the barriers' timeout: longer than any check here, shorter than the run."""
RUN_TIMEOUT_S = 300.0
"""A spawned run that takes longer fails the test (and its processes are killed)."""
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
"""GPU against CPU in float32 (same math, different kernels and summation order)."""
F64 = torch.float64


# -- the spawner (reusable) ---------------------------------------------------------------------------------


def rank_main(job: Callable, rank: int, size: int, folder: str) -> None:
    """One spawned rank on GPU 0: join the gloo group (file store), build its symmetric world, run
    `job(world)`, save its result or its error."""
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.set_num_threads(1)
    install_from_env()  # MOONEP_STRESS reaches the spawned ranks too (tests/stress.py)
    try:
        torch.cuda.set_device(0)
        world = init_symmetric("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=size,
                               timeout_s=TIMEOUT_S)
        result = job(world)
        torch.cuda.synchronize()
    except BaseException:  # noqa: B036 - reported to the parent, which fails the test
        result = {"error": traceback.format_exc()}
    torch.save(result, f"{folder}/rank{rank}.pt")


def spawn_symmetric(job: Callable[[SymmetricWorld], dict], size: int, folder: Path,
                    timeout_s: float = RUN_TIMEOUT_S) -> list[dict]:
    """`job(world)` on `size` processes sharing GPU 0, each a rank of one `SymmetricWorld`; their results in
    rank order. Fails on any rank's error, or past `timeout_s` (the processes are killed)."""
    return spawn_ranks(rank_main, job, size, folder, timeout_s)


# -- row exchanges: problems and their plain reference -----------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """Every rank's scatter entries (`rank_rn`, `row_rn [R, n]`, `values_rnw [R, n, W]`: each target row of
    the group written at most once, rank -1 entries in between) into `[rows, W]` targets that start at
    `-1 - rank`, then every rank's gather requests (`req_rank_rn`, `req_row_rn`) from those targets."""

    rank_rn: torch.Tensor
    row_rn: torch.Tensor
    values_rnw: torch.Tensor
    req_rank_rn: torch.Tensor
    req_row_rn: torch.Tensor
    rows: int

    @property
    def size(self) -> int:
        return self.rank_rn.shape[0]

    def capacity(self, rank_rn: torch.Tensor) -> int:
        """The most entries any rank addresses to any one rank (the tight `capacity`)."""
        counts = [int((rank_rn[s] == d).sum()) for s in range(self.size) for d in range(self.size)]
        return max(counts)

    def targets(self) -> list[torch.Tensor]:
        """Every rank's target after the scatter."""
        targets = [torch.full((self.rows, self.values_rnw.shape[2]), -1.0 - d) for d in range(self.size)]
        for s in range(self.size):
            for i, (d, row) in enumerate(zip(self.rank_rn[s].tolist(), self.row_rn[s].tolist(), strict=True)):
                if d >= 0:
                    targets[d][row] = self.values_rnw[s, i]
        return targets

    def gathered(self) -> list[torch.Tensor]:
        """Every rank's gather result."""
        targets = self.targets()
        return [torch.stack([targets[d][row] if d >= 0 else torch.zeros(self.values_rnw.shape[2])
                             for d, row in zip(self.req_rank_rn[s].tolist(), self.req_row_rn[s].tolist(),
                                               strict=True)])
                for s in range(self.size)]


def make_exchange(size: int, seed: int, skewed: bool, n: int = 24, rows: int = 16,
                  width: int = 5) -> Exchange:
    """Uniform: every rank's target gets 8..16 rows from random senders; skewed: rank 0's target gets every
    row, the others two each, and 80% of the gather requests go to rank 0."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for d in range(size):
        take = int(torch.randint(rows // 2, rows + 1, (), generator=gen))
        if skewed:
            take = rows if d == 0 else 2
        pairs += [(d, row) for row in torch.randperm(rows, generator=gen)[:take].tolist()]
    rank_rn = torch.full((size, n), -1, dtype=torch.int64)
    row_rn = torch.randint(0, rows, (size, n), generator=gen)  # rows of rank -1 entries are garbage
    for (d, row), slot in zip(pairs, torch.randperm(size * n, generator=gen).tolist(), strict=False):
        rank_rn[slot // n, slot % n], row_rn[slot // n, slot % n] = d, row
    req_rank_rn = torch.randint(-1, size, (size, n), generator=gen)
    if skewed:
        req_rank_rn = torch.where(torch.rand(size, n, generator=gen) < 0.8, 0, req_rank_rn)
    return Exchange(rank_rn, row_rn, torch.randn(size, n, width, generator=gen), req_rank_rn,
                    torch.randint(0, rows, (size, n), generator=gen), rows)


EXCHANGES = [("uniform", False, True), ("uniform-default-capacity", False, False), ("skewed", True, True)]
"""(name, skewed, tight capacity)."""


def exchange_case(size: int, name: str) -> tuple[Exchange, bool]:
    """The problem of the exchange case `name` (seeded by its position) and whether its capacity is tight."""
    index, (_, skewed, tight) = next((i, case) for i, case in enumerate(EXCHANGES) if case[0] == name)
    return make_exchange(size, seed=index, skewed=skewed), tight


def exchange(name: str, world, device: str) -> dict[str, torch.Tensor]:
    """One scatter into fresh targets, then one gather from them, in any world; results on the CPU."""
    problem, tight = exchange_case(world.size, name)
    r = world.rank
    target = world.symmetric(f"test/exchange/{name}", torch.full((problem.rows, problem.values_rnw.shape[2]),
                                                                 -1.0 - r, device=device))
    world.scatter_rows(target, problem.rank_rn[r].to(device), problem.row_rn[r].to(device),
                       problem.values_rnw[r].to(device),
                       capacity=problem.capacity(problem.rank_rn) if tight else None)
    scattered = target.local.clone()
    gathered = world.gather_rows(target, problem.req_rank_rn[r].to(device), problem.req_row_rn[r].to(device),
                                 capacity=problem.capacity(problem.req_rank_rn) if tight else None)
    world.release(target.key)
    return dict(scattered=scattered.cpu(), gathered=gathered.cpu())


# -- what runs in the spawned processes ---------------------------------------------------------------------


def gather_inputs(rank: int) -> list[torch.Tensor]:
    """An `[E]` int64 histogram, a 0-dim float, a bool vector and a bf16 matrix, different on every rank."""
    return [torch.arange(12) * (rank + 1), torch.tensor(rank + 0.5), torch.arange(5) % (rank + 2) == 0,
            torch.full((2, 3), rank - 1.25, dtype=torch.bfloat16)]


def barrier_phases(world: SymmetricWorld, phases: int, graph_replays: int) -> dict[str, torch.Tensor]:
    """Each phase: every rank fills its row of the next rank's `[R, 2^18]` tensor with the phase number,
    barrier, checks the row the previous rank wrote into its own tensor, barrier. Also all-gathers the
    phase. Errors are counted on the device; then the same phases run from a captured CUDA graph."""
    R, r, device = world.size, world.rank, world.device
    data = world.symmetric("test/phases", torch.zeros(R, 1 << 18, device=device))
    phase = torch.zeros((), device=device)
    errors = torch.zeros((), dtype=torch.int64, device=device)
    scale_r = torch.arange(1, R + 1, dtype=torch.float32, device=device)

    def run() -> None:
        for _ in range(phases):
            phase.add_(1)
            data.peer((r + 1) % R)[r].copy_(phase.expand(1 << 18))
            world.barrier()
            errors.add_((data.local[(r - 1) % R] != phase).sum())
            world.barrier()
            errors.add_((world.all_gather(phase * (r + 1)) != phase * scale_r).sum())

    run()
    eager = errors.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(graph_replays):
        graph.replay()
    return dict(eager=eager.cpu(), replayed=errors.cpu(), last_phase=phase.cpu())


def graph_exchange(world: SymmetricWorld, replays: int) -> list[dict[str, torch.Tensor]]:
    """A scatter and a gather captured in a CUDA graph, replayed with new values each time."""
    problem = make_exchange(world.size, seed=99, skewed=True)
    r, device = world.rank, world.device
    target = world.symmetric("test/graph/target", torch.zeros(problem.rows, problem.values_rnw.shape[2],
                                                                device=device))
    rank_n, row_n = problem.rank_rn[r].to(device), problem.row_rn[r].to(device)
    req_rank_n, req_row_n = problem.req_rank_rn[r].to(device), problem.req_row_rn[r].to(device)
    values_nw = problem.values_rnw[r].to(device)
    capacity, req_capacity = problem.capacity(problem.rank_rn), problem.capacity(problem.req_rank_rn)
    out = {}

    def step() -> None:
        world.scatter_rows(target, rank_n, row_n, values_nw, capacity=capacity)
        out["gathered"] = world.gather_rows(target, req_rank_n, req_row_n, capacity=req_capacity)

    side = torch.cuda.Stream()  # warm up off the default stream, as graph capture asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for replay in range(replays):
        values_nw.copy_(problem.values_rnw[r].to(device) * (replay + 2))
        target.local.fill_(-1.0 - r)
        graph.replay()
        results.append(dict(scattered=target.local.cpu(), gathered=out["gathered"].cpu()))
    return results


def without_host_sync(world: SymmetricWorld) -> str:
    """A barrier, an all-gather, a scatter and a gather under `set_sync_debug_mode("error")`."""
    problem = make_exchange(world.size, seed=5, skewed=False)
    r, device = world.rank, world.device
    target = world.symmetric("test/nosync/target", torch.zeros(problem.rows, problem.values_rnw.shape[2],
                                                                 device=device))
    inputs = [t.to(device) for t in (problem.rank_rn[r], problem.row_rn[r], problem.values_rnw[r],
                                     problem.req_rank_rn[r], problem.req_row_rn[r])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        world.barrier()
        world.all_gather(torch.arange(8, device=device))
        world.scatter_rows(target, *inputs[:3], capacity=problem.capacity(problem.rank_rn))
        world.gather_rows(target, *inputs[3:], capacity=problem.capacity(problem.req_rank_rn))
    except RuntimeError as error:
        return f"host sync: {error}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "ok"


BUFFER_CASE = dict(S=16, H=8, K=2, E=8, tp=4, kind="skewed", invalid=0.1, seed=4)


def buffer_step(world, device: str) -> dict[str, torch.Tensor]:
    """A Buffer step on skewed routing: dispatch, combine (rows scaled by their weights, weights back),
    prefetch_weight into the slot pool and reduce_grad of per-rank integer gradients."""
    case = Case(R=world.size, **BUFFER_CASE)
    r, epn = world.rank, case.epn
    buf = case.buffer(world)
    x = {k: v.to(device) for k, v in case.inputs(r).items()}
    rows_nvsh, weights_nvs, cu_seqlens, plan = dispatch(buf, x)
    out = dict(rows=rows_nvsh.clone(), weights=weights_nvs.clone(), cu_seqlens=cu_seqlens.clone(),
               dst=plan.dst.clone(), experts_to_copy=plan.experts_to_copy.clone())
    out["combined"], out["weights_sk"], _ = buf.combine(plan, rows_nvsh * weights_nvs[:, None], weights_nvs)
    gen = torch.Generator().manual_seed(50 + r)
    for name, shape in (("gate", GATE_NK), ("down", DOWN_NK)):
        full = full_weights(case, shape, seed=len(name))
        weights = ExpertRows(world.symmetric(f"test/buffer/{name}", full[r * epn:(r + 1) * epn].to(device)),
                             slot_pool(world, (buf.B, *shape), F64))
        buf.prefetch_weight(plan, weights, None, None)
        out[f"slots_{name}"] = weights.slots.local.clone()
        home_grad = torch.randint(-50, 51, (epn, *shape), generator=gen).to(device, F64)
        grads = ExpertRows(world.symmetric(f"test/buffer/{name}_grad", home_grad),
                           slot_grad_pool(world, (buf.B, *shape), F64))
        grads.slots.local.copy_(torch.randint(-50, 51, (buf.B, *shape), generator=gen).to(device, F64))
        buf.reduce_grad(plan, grads, None, None)
        out[f"home_grad_{name}"] = grads.home.local.clone()
        out[f"slot_grad_{name}"] = grads.slots.local.clone()
        grads.slots.local.zero_()  # the pools are process-global: leave them as a step would
        for key in (weights.home.key, grads.home.key):
            world.release(key)
    buf.destroy()
    return {k: v.cpu() for k, v in out.items()}


LAYER_CASES = [
    ("fp32-skewed", dict(dtype="float32", router={"dtype": "float32", "expert_bias": True}),
     dict(seed=2, skew=100.0), FP32_TOL),
    ("f64-padding", {}, dict(seed=3, skew=3.0, tokens=35, padding=7), TOL),
]
"""(name, config overrides, problem arguments, tolerance against the threads world on the CPU)."""


def layer_problem(size: int, name: str):
    _, overrides, args, _ = next(case for case in LAYER_CASES if case[0] == name)
    return make_problem(make_config(size, **overrides), **args)


def release_while_a_peer_reads(world: SymmetricWorld) -> dict:
    """Every rank registers a tensor of its rank + 1; rank 1 reads rank 0's late (behind a long sleep on its
    stream, or on the host on a CPU stand-in), then releases; rank 0 releases at once, then overwrites its
    memory, as a new tensor placed there would. `release` must not return on rank 0 before rank 1's read,
    queued before its own release, is done."""
    key = "test/release"
    tensor = world.symmetric(key, torch.full((4,), world.rank + 1.0, device=world.device))
    seen = None
    if world.rank == 1:
        if world.device.type == "cuda":
            torch.cuda._sleep(500_000_000)  # ~0.25 s on an H200
        else:
            time.sleep(0.5)
        seen = tensor.peer(0).clone()
    world.release(key)
    if world.rank == 0:
        tensor.local.fill_(-1.0)
    return {} if seen is None else {"seen": seen.cpu()}


def checks_job(world: SymmetricWorld) -> dict:
    """Every check of this module on one rank (see the module docstring)."""
    results: dict = {"all_gather": [world.all_gather(t.to(world.device)).cpu()
                                    for t in gather_inputs(world.rank)]}
    results["exchange"] = {name: exchange(name, world, "cuda") for name, *_ in EXCHANGES}
    results["phases"] = barrier_phases(world, phases=50, graph_replays=3)
    results["graph"] = graph_exchange(world, replays=3)
    results["no_sync"] = without_host_sync(world)
    results["buffer"] = buffer_step(world, "cuda")
    results["layer"] = {name: rank_step(layer_problem(world.size, name), world, "cuda")
                        for name, *_ in LAYER_CASES}
    layer = MoonEPMoELayer(make_config(world.size, world="symmetric"))
    results["default_world"] = layer.world is world
    layer.destroy()
    results["errors"] = misuse(world)
    results["release"] = release_while_a_peer_reads(world)
    return results


def misuse(world: SymmetricWorld) -> dict[str, str]:
    """The error of each misuse (every rank must raise, none may hang): rank 1 registering another shape,
    an all-gather larger than the board, a scatter into rows too large for a dump row, a registration
    while the weight pools use the expert arena (stood in for by a bare `PhysicalRows`)."""
    device = world.device
    big_rows = world.symmetric("test/big_rows", torch.zeros(2, 1 << 19, device=device))
    index_1 = torch.zeros(1, dtype=torch.int64, device=device)
    attempts = {
        "mismatch": lambda: world.symmetric("test/mismatch", torch.zeros(3 if world.rank == 1 else 2,
                                                                          device=device)),
        "board": lambda: world.all_gather(torch.zeros(1 << 20, device=device)),
        "no_dump": lambda: world.scatter_rows(big_rows, index_1 - 1, index_1, torch.zeros(1, 1 << 19,
                                                                                         device=device)),
        "arena": lambda: world.symmetric("test/arena", torch.zeros(2, device=device)),
    }
    errors = {}
    for name, attempt in attempts.items():
        if name == "arena":
            world.globals["test/arena"] = object.__new__(PhysicalRows)
        try:
            attempt()
            errors[name] = "no error"
        except (ValueError, NotImplementedError) as error:
            errors[name] = str(error)
        world.globals.pop("test/arena", None)
    return errors


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def group_run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    size = request.param
    return size, spawn_symmetric(checks_job, size, tmp_path_factory.mktemp(f"symmetric{size}"))


# -- checks against the reference and the threads world ----------------------------------------------------


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                tol: dict | None = None) -> None:
    """Same keys; integer tensors equal; floating ones equal, or close within `tol` where given."""
    assert got.keys() == want.keys(), what
    for key in got:
        if tol is not None and got[key].is_floating_point():
            torch.testing.assert_close(got[key], want[key], **tol, msg=lambda m, k=key: f"{what} {k}: {m}")
        else:
            assert torch.equal(got[key], want[key]), f"{what}: {key} differs"


def assert_all_gathers(size: int, gathered: list[list[torch.Tensor]]) -> None:
    """Every rank's all-gathers stack every rank's `gather_inputs`, dtype kept."""
    wants = [torch.stack(parts) for parts in zip(*(gather_inputs(r) for r in range(size)), strict=True)]
    for rank_gathers in gathered:
        for got, want in zip(rank_gathers, wants, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def assert_exchange(size: int, name: str, results: list[dict[str, torch.Tensor]]) -> None:
    """Every rank's scatter and gather equal the plain reference and the threads world's."""
    problem, _ = exchange_case(size, name)
    threads = run_ranks(lambda world: exchange(name, world, "cpu"), size)
    for rank, (got, ref) in enumerate(zip(results, threads, strict=True)):
        assert torch.equal(got["scattered"], problem.targets()[rank]), f"{name}: scatter on rank {rank}"
        assert torch.equal(got["gathered"], problem.gathered()[rank]), f"{name}: gather on rank {rank}"
        assert_same(got, ref, f"{name} on rank {rank} against threads")


def assert_misuse_errors(errors: list[dict[str, str]]) -> None:
    for rank_errors in errors:
        mismatch = rank_errors["mismatch"]
        assert "rank 1 registered" in mismatch or "rank(s) [1]" in mismatch, rank_errors
        assert "exceeds the board" in rank_errors["board"], rank_errors
        assert "no dump row" in rank_errors["no_dump"], rank_errors
        assert "expert arena" in rank_errors["arena"], rank_errors


@pytest.mark.gpu
def test_all_gather_stacks_every_rank(group_run):
    size, results = group_run
    assert_all_gathers(size, [res["all_gather"] for res in results])


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c[0] for c in EXCHANGES])
def test_scatter_and_gather_rows_match_reference_and_threads(group_run, name):
    size, results = group_run
    assert_exchange(size, name, [res["exchange"][name] for res in results])


@pytest.mark.gpu
def test_barriers_order_every_phase_eagerly_and_in_graph_replays(group_run):
    _, results = group_run
    for rank, res in enumerate(results):
        phases = res["phases"]
        assert int(phases["eager"]) == 0, f"rank {rank}: {int(phases['eager'])} stale reads in eager phases"
        assert int(phases["replayed"]) == 0, f"rank {rank}: {int(phases['replayed'])} stale reads in replays"
        assert float(phases["last_phase"]) == 50 * 4, "every replay ran every phase"


@pytest.mark.gpu
def test_exchange_replays_from_a_cuda_graph(group_run):
    size, results = group_run
    problem = make_exchange(size, seed=99, skewed=True)
    for replay in range(3):
        scaled = Exchange(problem.rank_rn, problem.row_rn, problem.values_rnw * (replay + 2),
                          problem.req_rank_rn, problem.req_row_rn, problem.rows)
        for rank, res in enumerate(results):
            got = res["graph"][replay]
            assert torch.equal(got["scattered"], scaled.targets()[rank]), (replay, rank)
            assert torch.equal(got["gathered"], scaled.gathered()[rank]), (replay, rank)


@pytest.mark.gpu
def test_exchange_needs_no_host_sync(group_run):
    assert all(res["no_sync"] == "ok" for res in group_run[1]), [res["no_sync"] for res in group_run[1]]


@pytest.mark.gpu
def test_buffer_step_matches_threads_exactly(group_run):
    size, results = group_run
    threads = run_ranks(lambda world: buffer_step(world, "cpu"), size)
    assert any(e >= 0 for e in results[0]["buffer"]["experts_to_copy"].view(-1).tolist()), "needs replicas"
    for rank, (res, ref) in enumerate(zip(results, threads, strict=True)):
        assert_same(res["buffer"], ref, f"buffer step on rank {rank}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_forward_backward_matches_threads(group_run, case):
    size, results = group_run
    name, _, _, tol = case
    threads = run_moonep(layer_problem(size, name))
    for rank, (res, ref) in enumerate(zip(results, threads, strict=True)):
        assert_same(res["layer"][name], ref, f"{name} on rank {rank}", tol)  # the plan and loads exactly
    if name == "fp32-skewed":
        assert int(results[0]["layer"][name]["slots_used"].sum()) > 0, "skewed routing needs replicas"


@pytest.mark.gpu
def test_symmetric_config_builds_the_default_world(group_run):
    assert all(res["default_world"] for res in group_run[1])


@pytest.mark.gpu
def test_misuse_raises_on_every_rank(group_run):
    assert_misuse_errors([res["errors"] for res in group_run[1]])


@pytest.mark.gpu
def test_release_waits_until_peers_are_done_with_the_memory(group_run):
    assert group_run[1][1]["release"]["seen"].tolist() == [1.0] * 4


# -- in this process ----------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_symmetric_world_needs_cuda():
    with pytest.raises(ValueError, match="needs CUDA"):
        SymmetricWorld()
    with pytest.raises(ValueError, match="needs CUDA"):
        MoonEPMoELayer(make_config(1, world="symmetric"))


@pytest.mark.gpu
def test_symmetric_world_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_symmetric"):
        SymmetricWorld()


@pytest.mark.parametrize("skewed", [False, True])
def test_write_peer_rows_matches_reference_on_cpu(skewed):
    """The sender-side write of the symmetric world, on CPU tensors with dump rows: every sender writes
    in turn, tight and default capacity."""
    problem = make_exchange(4, seed=11, skewed=skewed)
    for capacity in (problem.capacity(problem.rank_rn), None):
        targets = tuple(torch.full((problem.rows + 1, problem.values_rnw.shape[2]), -1.0 - d)
                        for d in range(problem.size))
        for s in range(problem.size):
            write_peer_rows(targets, problem.rank_rn[s], problem.row_rn[s], problem.values_rnw[s], capacity)
        for got, want in zip(targets, problem.targets(), strict=True):
            assert torch.equal(got[:-1], want)


def test_entries_by_rank_lists_each_ranks_entries_in_order():
    rank_n = torch.tensor([2, -1, 0, 2, 2, 0, -1])
    assert entries_by_rank(rank_n, 3, 3).tolist() == [[2, 5, 7], [7, 7, 7], [0, 3, 4]]
    assert entries_by_rank(rank_n, 3, None).shape == (3, 7)
    assert entries_by_rank(rank_n[:0], 3, 4).shape == (3, 0)


# -- on the CPU: the world's own code over a stand-in for torch's symmetric memory ------------------------


class StandIn:
    """Torch's symmetric memory and process group for R thread-ranks of this process on the CPU: `empty`
    allocates a CPU tensor, `rendezvous` hands every rank the tensors all ranks allocated in that call, and
    a handle's `barrier` is a `threading.Barrier`. A host barrier: it checks the world's own logic (dump
    rows, re-pointed tensors, the board, sender-side writes, peer reads), not device-side ordering."""

    def __init__(self, size: int):
        self.size = size
        self.host_barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self._lock = threading.Lock()
        self._calls = [0] * size
        self._allocations: dict[int, list[torch.Tensor | None]] = {}
        self._thread = threading.local()

    def enter(self, rank: int) -> None:
        self._thread.rank = rank

    def get_rank(self, group) -> int:
        return self._thread.rank

    def get_world_size(self, group) -> int:
        return self.size

    def get_backend(self, device) -> str:
        return "CUDA"

    def empty(self, shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def rendezvous(self, memory: torch.Tensor, group) -> StandInHandle:
        rank = self._thread.rank
        with self._lock:
            call, self._calls[rank] = self._calls[rank], self._calls[rank] + 1
            self._allocations.setdefault(call, [None] * self.size)[rank] = memory
        self.host_barrier.wait()
        return StandInHandle(self, rank, list(self._allocations[call]))


@dataclass
class StandInHandle:
    stand_in: StandIn
    rank: int
    memories: list[torch.Tensor]

    def get_remote_tensor(self, rank: int, shape, dtype) -> torch.Tensor:
        assert self.memories[rank].shape == shape and self.memories[rank].dtype == dtype
        return self.memories[rank]

    def barrier(self, channel: int, timeout_ms: int) -> None:
        self.stand_in.host_barrier.wait()


def run_stand_in(fn: Callable[[SymmetricWorld], dict], size: int, monkeypatch) -> list[dict]:
    """`fn(world)` on `size` thread-ranks, each with a `SymmetricWorld` over a `StandIn`."""
    stand_in = StandIn(size)
    monkeypatch.setattr(symmetric_module, "symm_mem", stand_in)
    monkeypatch.setattr(symmetric_module, "resolve_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", stand_in.get_rank)
    monkeypatch.setattr(dist, "get_world_size", stand_in.get_world_size)
    for name, value in NO_MULTICAST_ENV.items():
        monkeypatch.setenv(name, value)

    def rank_fn(threads_world) -> dict:
        stand_in.enter(threads_world.rank)
        try:
            return fn(SymmetricWorld(stand_in, "cpu"))
        except BaseException:
            stand_in.host_barrier.abort()  # the peers stop waiting at once
            raise

    return run_ranks(rank_fn, size)


def stand_in_job(world: SymmetricWorld) -> dict:
    return dict(all_gather=[world.all_gather(t) for t in gather_inputs(world.rank)],
                exchange={name: exchange(name, world, "cpu") for name, *_ in EXCHANGES},
                buffer=buffer_step(world, "cpu"),
                layer=rank_step(layer_problem(world.size, "fp32-skewed"), world, "cpu"),
                errors=misuse(world))


def test_release_waits_for_peers_on_a_cpu_stand_in(monkeypatch):
    """`release` is collective: rank 0 releasing (then reusing its memory) at once while rank 1 still has to
    read it through its mapping must wait for rank 1's release, which follows the read."""
    results = run_stand_in(release_while_a_peer_reads, 2, monkeypatch)
    assert results[1]["seen"].tolist() == [1.0] * 4


@pytest.mark.parametrize("size", [2, 4])
def test_world_on_a_cpu_stand_in_equals_threads(size, monkeypatch):
    """With symmetric memory stood in for on the CPU, the world's all-gather, exchanges, Buffer step and
    layer forward + backward equal the reference and the threads world bit for bit."""
    results = run_stand_in(stand_in_job, size, monkeypatch)
    assert_all_gathers(size, [res["all_gather"] for res in results])
    for name, *_ in EXCHANGES:
        assert_exchange(size, name, [res["exchange"][name] for res in results])
    for res, ref in zip(results, run_ranks(lambda world: buffer_step(world, "cpu"), size), strict=True):
        assert_same(res["buffer"], ref, "buffer")
    for res, ref in zip(results, run_moonep(layer_problem(size, "fp32-skewed")), strict=True):
        assert_same(res["layer"], ref, "layer")
    assert_misuse_errors([res["errors"] for res in results])
