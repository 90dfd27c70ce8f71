"""One rank of an EP group replayed alone: what rank d computes in one training step of the layer, on one
device, its peers stood in for.

Notation and suffixes: DESIGN.md, "Notation" (`m`: rows a peer writes, `v`: route weights, `p`: duplicate
pairs).

The seam is the EP world. `ReplayWorld` is an `EPWorld` of R ranks in which only rank d runs: d builds the
unchanged `MoonEPMoELayer` on it (its Buffer, home experts, slot pools and grouped GEMM, chosen as the layer
chooses them) and runs the layer's expert step (`moe.experts_step`, the router's choice given: the routed
step, and the shared experts where the config has them, beside it as the layer runs them) forward and
backward. Every kernel d launches is d's real work: the planner on the group's histogram, its own tokens'
rows sent, the dup tables and duplicate rows, the prefetch of the replicas it hosts, the grouped GEMMs and
SwiGLU over the rows the plan gives it, combine's pre-reduction and gather of its tokens' rows, the replicas'
gradients of its home experts pulled back. What the peers do is stood in for:

- their memory: one stand-in per Buffer tensor that peers' rows land in (`STAND_IN_KINDS`: rows, route
  weights, duplicate pairs), shared by all peers (`StandIns`), which d's kernels write into and read from;
  every other symmetric tensor (home experts, slot pools, slot gradients) maps each peer onto d's own
  tensor, so d's prefetch and reduce_grad read the same bytes from d's memory;
- their traffic into and out of d's memory (`PeerTraffic`, one per exchange call, `PHASES`): their rows,
  route weights and duplicate pairs written into d's Buffer (`Incoming`, staged: the real values they
  would send), and their reads of d's memory (d's rows in combine, d's home experts in prefetch, d's slot
  gradients in reduce_grad) as copies into scratch. On CUDA this traffic runs on a side stream (the peers'
  stream): it starts when d reaches an exchange call's first barrier and d waits for it at the call's second
  barrier, as the row kernels' barriers order a real group's phases; so it overlaps d's own kernels of that
  window and nothing else, as it would. A prefetch has one barrier (`OPEN_ENDED`): the peers' reads of d's
  experts run from it until the next call's first barrier, beside d's GEMMs. On the CPU it runs inline, and
  with the torch reference exchange (the layer's choice on the CPU) the staged writes land in the world's
  `scatter_rows`.
- the histogram all-gather: every peer's histogram is posted beforehand (`ReplayWorld.posted`).

Each exchange call is one window (`ReplayWorld.windows`: its phase and its start and end on the stream it ran
on: the caller's, or the comm stream for a prefetch and backward's combine, which run beside a GEMM; a
prefetch's ends at the next call's first barrier), so a link model can stretch each window to the link's time
for the bytes it moves (`bench.ep_group`). Where the caller's stream waits for a prefetch's replicas (after
the home experts' groups of the first GEMM: `SlotsReady.wait`) is stamped too (`ReplayWorld.slot_waits`):
the time from the prefetch's start to that wait is what its link time can hide under.

Left out: the peers' SMs (their kernels never run here), contention on real links, NVLink latency and the
peers' skew in reaching a barrier. A local copy moves bytes at HBM speed, not the link's.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import Stamp, seconds_between, stamp
from moonep_moe.comm.exchange import primary_rows
from moonep_moe.config import MoEConfig
from moonep_moe.gemm.base import SlotsReady
from moonep_moe.layers.moe import MoonEPMoELayer, experts_step
from moonep_moe.layers.router import RouterOutput
from moonep_moe.plan.planner import expert_histogram, plan_routes
from moonep_moe.plan.types import MoonEPCommPlan, decode_dst
from moonep_moe.transport.peer import place_rows, read_peer_rows
from moonep_moe.transport.world import SymmetricTensor, indexed_device

PHASES = ("send_routes", "copy_experts", "combine", "send_routes", "copy_experts", "combine", "add_replicas")
"""The row exchange's calls in one training step of the layer, in order (forward dispatch, prefetch,
combine; backward dispatch, prefetch, combine; reduce_grad): each is a window between two barriers of the
row kernels' exchange (`comm.exchange.KernelExchange`)."""

OPEN_ENDED = ("copy_experts",)
"""The exchange calls with one barrier: the layer's prefetch (`prefetch_weight(wait_for_readers=False)`)
goes on after it while the peers read this rank's home experts; the next call's first barrier orders those
reads, so their traffic runs (and the call's window lasts) until then."""

DISPATCHES = tuple(i for i, phase in enumerate(PHASES) if phase == "send_routes")
"""The forward and backward dispatch's indices in `PHASES`."""

STAND_IN_KINDS = ("rows", "weights", "dup_pairs")
"""The Buffer's symmetric tensors (the last part of their key) that get stand-ins of their own on the peers:
the tensors peers' rows land in. Every other symmetric tensor maps the peers onto this rank's own."""


# -- the group: inputs, plans, traffic --------------------------------------------------------------------


@dataclass
class GroupStep:
    """One training step of an EP group: every rank's inputs and its plan from the real planner.

    Attributes:
        cfg: the layer config (`ep_size` = R, `balance` the policy).
        topk: per rank `[S, K]` int32 experts. weights: per rank `[S, K]` route weights (the Buffer's weight
            dtype). hidden, grad_out: per rank `[S, H]` tokens and output gradient, the config's dtype.
        counts_re: `[R, E]` int64, the gathered histogram.
        plans: every rank's plan (`plan_routes` with that rank's routes, as its dispatch computes it).
    """

    cfg: MoEConfig
    topk: list[torch.Tensor]
    weights: list[torch.Tensor]
    hidden: list[torch.Tensor]
    grad_out: list[torch.Tensor]
    counts_re: torch.Tensor
    plans: list[MoonEPCommPlan]

    @property
    def num_ranks(self) -> int:
        return self.cfg.ep_size


def plan_group(cfg: MoEConfig, topk: list[torch.Tensor]) -> tuple[torch.Tensor, list[MoonEPCommPlan]]:
    """The group's histogram `[R, E]` (`expert_histogram` per rank) and every rank's plan, as each rank's
    dispatch makes it (`plan_routes` with the Buffer's arguments: B, tp, NvS and the policy's
    `replica_cost`). The global part is identical on every rank."""
    counts_re = torch.stack([expert_histogram(t, cfg.num_experts) for t in topk])
    kwargs = dict(num_slots=cfg.prefetch_slots, token_padding=cfg.token_padding,
                  rows_per_rank=cfg.rows_per_rank, replica_cost=cfg.replica_cost)
    return counts_re, [plan_routes(counts_re, t, rank=r, **kwargs) for r, t in enumerate(topk)]


def group_step(cfg: MoEConfig, topk: list[torch.Tensor], weights: list[torch.Tensor],
               hidden: list[torch.Tensor], grad_out: list[torch.Tensor]) -> GroupStep:
    """`GroupStep` of these inputs, planned (`plan_group`)."""
    counts_re, plans = plan_group(cfg, topk)
    return GroupStep(cfg, topk, weights, hidden, grad_out, counts_re, plans)


def route_matrices(step: GroupStep) -> dict[str, torch.Tensor]:
    """`[R, R]` int64 counts of what rank r sends rank d in a dispatch (r, d): `payload` rows (primary routes:
    one row per token and destination), `routes` (valid routes: a route weight each) and `duplicates`
    (routes that carry only their weight and a duplicate pair)."""
    num_ranks = step.num_ranks
    out = {name: torch.zeros(num_ranks, num_ranks, dtype=torch.int64) for name in ("payload", "routes",
                                                                                  "duplicates")}
    for r, plan in enumerate(step.plans):
        dest_n, _, primary_n, valid_n = (t.cpu() for t in decode_dst(plan.dst, plan.rows_per_rank))
        for name, mask_n in (("payload", valid_n & primary_n), ("routes", valid_n),
                             ("duplicates", valid_n & ~primary_n)):
            out[name][r] = torch.bincount(dest_n[mask_n], minlength=num_ranks)
    return out


def replica_counts(step: GroupStep) -> tuple[torch.Tensor, torch.Tensor]:
    """`([R], [R])`: the replicas each rank hosts (its used slots) and the replicas of each rank's home
    experts hosted elsewhere."""
    table_rb = step.plans[0].experts_to_copy.long().cpu()
    epn = step.cfg.experts_per_rank
    used_rb = table_rb >= 0
    owner_n = (table_rb[used_rb] // epn)
    return used_rb.sum(1), torch.bincount(owner_n, minlength=step.num_ranks)


# -- what the peers do to rank d's memory -----------------------------------------------------------------


@dataclass
class Incoming:
    """What the peers write into rank d's Buffer in one dispatch, staged: each a pair (rows or slots of d's
    tensor `[m]` int64, values `[m, ...]`), or None where that dispatch sends none (route weights and
    duplicate pairs go with the forward dispatch only)."""

    rows: tuple[torch.Tensor, torch.Tensor]
    weights: tuple[torch.Tensor, torch.Tensor] | None = None
    dup_pairs: tuple[torch.Tensor, torch.Tensor] | None = None

    def write(self, kind: str, target: torch.Tensor) -> None:
        """This dispatch's `kind` (one of `STAND_IN_KINDS`) into `target`, d's tensor of that kind."""
        staged = getattr(self, kind)
        if staged is not None:
            index_m, values_m = staged
            target.index_copy_(0, index_m, values_m)

    @property
    def nbytes(self) -> int:
        return sum(values.nbytes for staged in (self.rows, self.weights, self.dup_pairs) if staged is not None
                   for values in staged[1:])


def incoming(step: GroupStep, rank: int, backward: bool) -> Incoming:
    """What rank `rank`'s peers write into its Buffer in the forward dispatch (their token rows, every valid
    route's weight, their duplicate routes' pairs) or the backward one (their output gradients' rows), with
    the values their send kernels write (`comm.kernels.rows.send_routes`). Host reads (staging, untimed)."""
    cfg, nvs, top_k = step.cfg, step.plans[0].rows_per_rank, step.cfg.top_k
    routes = cfg.max_tokens_per_rank * top_k
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {kind: [] for kind in STAND_IN_KINDS}
    for r, plan in enumerate(step.plans):
        if r == rank:
            continue
        dest_n, row_n, primary_n, valid_n = decode_dst(plan.dst, nvs)
        to_me_n = valid_n & (dest_n == rank)
        payload_n = to_me_n & primary_n
        token_n = torch.arange(plan.dst.numel(), device=plan.dst.device) // top_k
        rows_sh = step.grad_out[r] if backward else step.hidden[r]
        parts["rows"].append((row_n[payload_n], rows_sh.index_select(0, token_n[payload_n])))
        if backward:
            continue
        parts["weights"].append((row_n[to_me_n], step.weights[r].reshape(-1)[to_me_n]))
        dup_n = to_me_n & ~primary_n
        pairs_n2 = torch.stack([row_n.to(torch.int32), primary_rows(plan.dst, nvs, top_k)], 1)
        slot_n = r * routes + torch.arange(plan.dst.numel(), device=plan.dst.device)
        parts["dup_pairs"].append((slot_n[dup_n], pairs_n2[dup_n]))

    def joined(kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not parts[kind]:
            return None
        index, values = zip(*parts[kind], strict=True)
        return torch.cat(index).long(), torch.cat(values)

    if not parts["rows"]:  # one rank: nobody writes into it
        empty = step.hidden[rank][:0]
        return Incoming((torch.zeros(0, dtype=torch.int64, device=empty.device), empty))
    return Incoming(joined("rows"), joined("weights"), joined("dup_pairs"))


@dataclass
class PeerTraffic:
    """The peers' part of one exchange call (one of `PHASES`) on rank d's memory: their writes into d's Buffer
    (`incoming`, a dispatch's) and their reads of d's memory (`reads`, a callable copying what they read
    into scratch), either None."""

    incoming: Incoming | None = None
    reads: Callable[[], None] | None = None


# -- the world -----------------------------------------------------------------------------------------------


class StandIns:
    """The peers' memory: one tensor per `STAND_IN_KINDS` entry, dtype and shape (as this rank's own: the
    Buffer views every peer's rows in other layouts too), shared by every peer and by every rank replayed
    with the same Buffer shape. Owns its tensors; their values are whatever this rank's kernels wrote."""

    def __init__(self):
        self._tensors: dict[tuple, torch.Tensor] = {}

    def get(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        key = (kind, like.dtype, like.device, tuple(like.shape))
        if key not in self._tensors:
            self._tensors[key] = torch.zeros_like(like)
        return self._tensors[key]


def key_kind(key: str) -> str:
    """The last part of a symmetric tensor's key (`"buffer0/rows"` -> `"rows"`)."""
    return key.rsplit("/", 1)[-1]


@dataclass(eq=False)
class ReplayWorld:
    """Rank `rank` of an EP group of `size` ranks in which only this rank runs (module docstring). An
    `EPWorld`: the layer and its Buffer run on it unchanged. State: the registry of this rank's symmetric
    tensors, the histograms posted for the next all-gather, and during a step (`step()`) the peers' traffic
    of each exchange call and the windows measured."""

    rank: int
    size: int
    device: torch.device
    stand_ins: StandIns
    globals: dict[Any, Any] = field(default_factory=dict)
    posted: torch.Tensor | None = None
    """`[R, ...]` what every rank contributes to the next `all_gather` (row `rank` is replaced by this
    rank's own); None: every peer contributes what this rank does (construction-time gathers)."""
    windows: list[tuple[str, Stamp, Stamp]] = field(default_factory=list)
    """The last step's exchange calls: (phase, start, end) on the stream each ran on (CUDA events), or clock
    times."""
    slot_waits: list[Stamp] = field(default_factory=list)
    """The last step's waits for the prefetched replicas, one per prefetch, stamped on the caller's stream
    right after the wait (so after the home groups' GEMM was queued)."""

    def __post_init__(self):
        self._registered: dict[str, torch.Tensor] = {}
        self._traffic: list[PeerTraffic] | None = None
        self._call = 0
        self._start: Stamp | None = None
        self._open: tuple[str, Stamp] | None = None  # an `OPEN_ENDED` call (phase, start) until the next call
        self._scatters: Counter[str] = Counter()
        self._peers_done: torch.cuda.Event | None = None
        self._peer_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- the EPWorld protocol

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.posted is None:
            return torch.stack([tensor] * self.size)
        gathered = self.posted.to(device=tensor.device, dtype=tensor.dtype).clone()
        gathered[self.rank] = tensor
        return gathered

    def barrier(self) -> None:
        """Outside a step: nothing to order (only this rank runs). In a step: the first barrier of an exchange
        call starts the peers' traffic of that call, the second waits for it; an `OPEN_ENDED` call's traffic
        is waited for at the next call's first barrier (module docstring)."""
        if self._traffic is None:
            return
        if self._start is None:
            caller = sys._getframe(1).f_code.co_name
            expected = PHASES[self._call] if self._call < len(PHASES) else "no further exchange call"
            if caller != expected:
                raise RuntimeError(f"rank replay: exchange call {self._call} is {caller}, expected "
                                   f"{expected}: the layer's step no longer matches bench.rank_replay.PHASES")
            self._close_open()
            self._start = stamp(self.device)
            self._start_peers(self._traffic[self._call])
            if expected in OPEN_ENDED:
                self._open, self._start = (expected, self._start), None
                self._call += 1
        else:
            self._wait_peers()
            self.windows.append((PHASES[self._call], self._start, stamp(self.device)))
            self._start = None
            self._call += 1

    def _wait_peers(self) -> None:
        if self._peers_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._peers_done)
            self._peers_done = None

    def _close_open(self) -> None:
        """End the window of the `OPEN_ENDED` call before this one, if any, once its peers' reads are done."""
        if self._open is not None:
            self._wait_peers()
            phase, start = self._open
            self.windows.append((phase, start, stamp(self.device)))
            self._open = None

    def symmetric(self, key: str, tensor: torch.Tensor) -> SymmetricTensor:
        if key in self._registered:
            raise ValueError(f"symmetric key {key!r} is already registered on rank {self.rank}")
        self._registered[key] = tensor
        kind = key_kind(key)
        peer = self.stand_ins.get(kind, tensor) if kind in STAND_IN_KINDS else tensor
        return SymmetricTensor(key, self.rank, tuple(tensor if r == self.rank else peer
                                                     for r in range(self.size)))

    def scatter_rows(self, target: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                     values_n: torch.Tensor, *, capacity: int | None = None) -> None:
        """This rank's entries written into each rank's tensor (the peers' stand-ins); then, in a step, the
        peers' staged writes into this rank's (the torch reference exchange's dispatch)."""
        for r, peer in enumerate(target.peers):
            place_rows(peer, torch.where(rank_n == r, row_n, -1), values_n.to(peer.dtype))
        kind = key_kind(target.key)
        if self._traffic is not None and kind in STAND_IN_KINDS:
            sending = [t.incoming for t in self._traffic
                       if t.incoming is not None and getattr(t.incoming, kind) is not None]
            sending[self._scatters[kind]].write(kind, target.local)
            self._scatters[kind] += 1

    def gather_rows(self, source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor, *,
                    capacity: int | None = None) -> torch.Tensor:
        return read_peer_rows(source, rank_n, row_n, capacity)

    def release(self, key: str) -> None:
        self._registered.pop(key, None)

    # -- the replay

    def local(self, kind: str) -> torch.Tensor:
        """This rank's registered tensor whose key ends in `kind` (a Buffer's rows, weights, dup pairs)."""
        found = [t for key, t in self._registered.items() if key_kind(key) == kind]
        if len(found) != 1:
            raise RuntimeError(f"rank replay: {len(found)} symmetric tensors of kind {kind!r} on rank "
                               f"{self.rank}, expected one (one Buffer per replayed layer)")
        return found[0]

    def _start_peers(self, traffic: PeerTraffic) -> None:
        """The peers' traffic of one exchange call: after this rank's queued work, on the peers' stream (CUDA)
        or inline; the reference exchange's writes land in `scatter_rows` instead."""

        def run() -> None:
            if traffic.incoming is not None:
                for kind in STAND_IN_KINDS:
                    traffic.incoming.write(kind, self.local(kind))
            if traffic.reads is not None:
                traffic.reads()

        if self._peer_stream is None:
            run()
            return
        self._peer_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._peer_stream):
            run()
            self._peers_done = torch.cuda.Event()
            self._peers_done.record(self._peer_stream)

    @contextlib.contextmanager
    def step(self, traffic: list[PeerTraffic], reference_exchange: bool) -> Iterator[None]:
        """One training step of this rank with the peers' `traffic` (one per `PHASES` entry). With
        `reference_exchange` (the torch reference: no barriers, dispatches through `scatter_rows`) only the
        peers' writes are replayed; with the row kernels every call's traffic runs in its window. Raises
        after the step unless every exchange call (or every staged write) happened."""
        if len(traffic) != len(PHASES):
            raise ValueError(f"rank replay: traffic needs one entry per phase ({len(PHASES)}), got "
                             f"{len(traffic)}")
        self._traffic, self._call, self._start, self._open = traffic, 0, None, None
        self._scatters.clear()
        self.windows, self.slot_waits = [], []
        wait = SlotsReady.wait

        def stamped_wait(ready: SlotsReady) -> None:
            wait(ready)
            self.slot_waits.append(stamp(self.device))

        SlotsReady.wait = stamped_wait
        try:
            yield
            self._close_open()
        finally:
            self._traffic = None
            SlotsReady.wait = wait
        if reference_exchange:
            staged = Counter(kind for t in traffic if t.incoming is not None for kind in STAND_IN_KINDS
                             if getattr(t.incoming, kind) is not None)
            if self._scatters != staged:
                raise RuntimeError(f"rank replay: the step wrote {dict(self._scatters)} of the peers' staged "
                                   f"dispatches, expected {dict(staged)}")
        elif self._call != len(PHASES):
            raise RuntimeError(f"rank replay: the step made {self._call} exchange calls, expected "
                               f"{len(PHASES)} ({', '.join(PHASES)})")

    def window_seconds(self) -> list[tuple[str, float]]:
        """The last step's windows as (phase, seconds); on CUDA after the step has completed."""
        return [(phase, seconds_between(start, end)) for phase, start, end in self.windows]


# -- one rank's step -----------------------------------------------------------------------------------------


def rank_traffic(step: GroupStep, rank: int, layer: MoonEPMoELayer, world: ReplayWorld) -> list[PeerTraffic]:
    """The peers' traffic on rank `rank`'s memory in each exchange call of one step (`PHASES`): their writes
    into its Buffer in both dispatches (`incoming`), their reads of its rows (combine: the primary rows
    their routes point at, and in backward the route weights too), of its home experts they replicate
    (prefetch) and of its used slots' gradients (reduce_grad), as copies into scratch that this function
    allocates. `layer` is the rank's layer on `world`."""
    forward, backward = incoming(step, rank, backward=False), incoming(step, rank, backward=True)
    rows_nvsh, weights_nvs = world.local("rows"), world.local("weights")
    read_rows_m = forward.rows[0]
    read_weights_v = forward.weights[0] if forward.weights is not None else read_rows_m[:0]
    scratch_mh = rows_nvsh.new_empty((len(read_rows_m), rows_nvsh.shape[1]))
    scratch_v = weights_nvs.new_empty(len(read_weights_v))
    epn = step.cfg.experts_per_rank
    table_rb = step.plans[rank].experts_to_copy.long()
    held_rb = (table_rb >= 0) & (table_rb // epn == rank)
    held_rb[rank] = False
    replicated = (table_rb[held_rb] % epn).tolist()  # home experts of this rank that peers replicate
    used = (table_rb[rank] >= 0).nonzero().flatten().tolist()  # slots this rank fills
    home = (layer.experts.gate_up.detach(), layer.experts.down.detach())
    slot_grads = tuple(pool.local for pool in layer.experts.slot_grads)
    expert_scratch = tuple(t.new_empty(t.shape[1:]) for t in home)
    grad_scratch = tuple(t.new_empty(t.shape[1:]) for t in slot_grads)

    def copies(sources: tuple[torch.Tensor, ...], scratch: tuple[torch.Tensor, ...], index: list[int]):
        def run() -> None:
            for i in index:
                for source, out in zip(sources, scratch, strict=True):
                    out.copy_(source[i])
        return run

    def read_rows(with_weights: bool):
        def run() -> None:
            torch.index_select(rows_nvsh, 0, read_rows_m, out=scratch_mh)
            if with_weights:
                torch.index_select(weights_nvs, 0, read_weights_v, out=scratch_v)
        return run

    prefetch = copies(home, expert_scratch, replicated)
    return [PeerTraffic(incoming=forward), PeerTraffic(reads=prefetch), PeerTraffic(reads=read_rows(False)),
            PeerTraffic(incoming=backward), PeerTraffic(reads=prefetch), PeerTraffic(reads=read_rows(True)),
            PeerTraffic(reads=copies(slot_grads, grad_scratch, used))]


@dataclass
class RankInputs:
    """Rank d's leaf tensors of a step: its tokens and route weights (each requiring a gradient, as the
    router's output does), its experts and output gradient."""

    hidden_sh: torch.Tensor
    weights_sk: torch.Tensor
    topk_sk: torch.Tensor
    grad_sh: torch.Tensor


def rank_inputs(step: GroupStep, rank: int) -> RankInputs:
    """Rank `rank`'s leaves of the step (fresh leaves over the group's tensors)."""
    return RankInputs(step.hidden[rank].detach().requires_grad_(),
                      step.weights[rank].detach().requires_grad_(), step.topk[rank], step.grad_out[rank])


def train_step(layer: MoonEPMoELayer, inputs: RankInputs) -> torch.Tensor:
    """One training step of the layer's experts on one rank, the router's choice given: fresh gradients,
    `moe.experts_step` (MoonEPExperts: dispatch, prefetch, grouped GEMMs and SwiGLU, combine; the shared
    experts where the layer has them) forward, then backward. Returns the output `[S, H]`."""
    layer.zero_grad(set_to_none=True)
    inputs.hidden_sh.grad = inputs.weights_sk.grad = None
    empty = inputs.weights_sk.new_empty(0)
    routing = RouterOutput(inputs.topk_sk, inputs.weights_sk, empty, None, None)
    out_sh = experts_step(layer, inputs.hidden_sh, routing)
    out_sh.backward(inputs.grad_sh)
    return out_sh


def replay_layer(cfg: MoEConfig, rank: int, stand_ins: StandIns, device: torch.device | str
                 ) -> tuple[MoonEPMoELayer, ReplayWorld]:
    """Rank `rank`'s `MoonEPMoELayer` built from `cfg` on a fresh `ReplayWorld` (its comm memory, experts
    and grouped GEMM as the layer makes them; experts initialised as the layer does)."""
    world = ReplayWorld(rank, cfg.ep_size, indexed_device(device), stand_ins)
    return MoonEPMoELayer(cfg, world), world


def replay_step(layer: MoonEPMoELayer, world: ReplayWorld, step: GroupStep, inputs: RankInputs,
                traffic: list[PeerTraffic]) -> torch.Tensor:
    """One training step of `layer` (rank `world.rank`'s) in the group `step`, its peers replayed: the
    group's histogram posted, `traffic` in each exchange call's window."""
    world.posted = step.counts_re
    reference = not layer.buffer.uses_kernels
    with world.step(traffic, reference_exchange=reference):
        return train_step(layer, inputs)
