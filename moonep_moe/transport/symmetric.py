"""The symmetric-memory EP world: `EPWorld` over `torch.distributed._symmetric_memory` (CUDA backend), for the
ranks of one NVLink domain, one process and one GPU per rank.

Every rank maps every peer's symmetric tensors, so rows move by plain loads and stores into peers' memory
(notation: DESIGN.md; as in the world protocol, n counts a call's entries, c is its `capacity`, `*row`
the row shape):

- `symmetric(key, tensor)`: allocates the tensor in symmetric memory (`symm_mem.empty`, plus one dump row
  where a row is small, see `DUMP_ROW_MAX_BYTES`), copies the contents, re-points `tensor` at it (so a
  parameter stays the memory peers read) and rendezvouses on the group; `peers[r]` are ordinary tensors over
  rank r's memory (ordinary torch ops on them read and write that rank; `peers[r].data_ptr()` is rank r's
  address as mapped in this process, for pointer tables of Triton kernels). Collective, not capturable in a
  CUDA graph: register everything at construction.
- `barrier()`: on the device (`hdl.barrier` on channel `BARRIER_CHANNEL` of the world's board), queued on
  the current stream: work this rank queues after it starts once every rank's work queued before it is done.
  No host sync; the signal pads reset themselves, so a captured step replays.
- `all_gather(t)`: each rank writes its bytes into every peer's board between two barriers, then copies its
  board (`[R, *shape]`, no host sync; at most `board_bytes` bytes per rank).
- `scatter_rows`: the sender writes straight into the peers' targets (`world.write_peer_rows`, R * c rows);
  `gather_rows`: the reader reads the peers' sources (`world.read_peer_rows`, shared with the threads
  world). Both between barriers.

NVLink multicast (NVLS) is never used: the world sets `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`,
`NCCL_NVLS_ENABLE=0` and `NVSHMEM_DISABLE_NVLS=1` (unless already set) before its first rendezvous.

Several processes can share ONE GPU (tests): set `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1` and use a gloo
process group (NCCL refuses two ranks on one device). Timings there are meaningless.

Launching: one process per rank (`torchrun`), `init_symmetric()` (or your own process group, then
`symmetric_world()`), the rank's work inside `collective.fail_fast()`. A rank stuck at a barrier (a peer that
died) fails after the barrier timeout: the device traps and the process exits with a CUDA error.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from moonep_moe.transport.arena import PhysicalRows
from moonep_moe.transport.collective import (
    DEFAULT_TIMEOUT_S,
    check_same_registration,
    init_collective,
    joined_group,
)
from moonep_moe.transport.peer import PeerWorld, write_peer_rows
from moonep_moe.transport.world import BARRIER_TIMEOUT_S, SymmetricTensor, indexed_device, reinterpret_rows

NO_MULTICAST_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
                    "NVSHMEM_DISABLE_NVLS": "1"}
"""Set (unless already set) before the first rendezvous: no NVLink multicast anywhere."""
BOARD_KEY = "symmetric_world/board"
"""The world's own symmetric tensor: the all-gather board, whose signal pad carries the barriers."""
BARRIER_CHANNEL = 0
"""`hdl.barrier` channel of the world's barriers: signal slots `[R * channel, R * channel + R)` of the board's
signal pad (symmetric tensors that share the board's allocation share that pad: kernels with their own
signals must keep clear of these slots)."""
BOARD_BYTES = 64 * 1024
"""Default bytes per rank of the all-gather board (the `[E]` int64 histogram of E = 8192 experts)."""
DUMP_ROW_MAX_BYTES = 1 << 20
"""Symmetric tensors whose row (`tensor[0]`) is at most this many bytes get one hidden dump row, so they can
be `scatter_rows` targets. Larger rows (whole experts: weights, gradients, slots) get none: they are only
ever read by peers, and an extra expert per tensor would waste memory."""


def disable_multicast() -> None:
    """Set `NO_MULTICAST_ENV` in this process where unset (before the first rendezvous, to take effect)."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


class SymmetricWorld(PeerWorld):
    """Rank `rank` of an EP group over symmetric memory: the ranks of a process group, one GPU each.

    Owns its board (the all-gather exchange, whose handle also carries the barriers) and the rendezvous
    handles of every registered tensor (released by `release`). Every method except the attributes is
    collective: every rank calls them in the same order.

    Args:
        group: the process group of the EP ranks (rank = group rank); default the WORLD group, which must be
            initialised (`init_symmetric`). Any backend: the group only carries the rendezvous (gloo lets
            several ranks share one GPU).
        device: this rank's GPU; default `cuda:LOCAL_RANK` where LOCAL_RANK is set, else the current device.
        board_bytes: the most bytes per rank one `all_gather` can move.
        timeout_s: a barrier that waits longer traps on the device (the process fails instead of hanging).
    """

    moves_registered_tensors = True
    """`symmetric()` moves a tensor into symmetric memory: the weight pools then do without the arena."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None, *,
                 board_bytes: int = BOARD_BYTES, timeout_s: float = BARRIER_TIMEOUT_S):
        device = resolve_device(device)
        self.group, self.rank, self.size = joined_group(group, "symmetric", "symmetric.init_symmetric")
        self.device = device
        self.globals: dict[Any, Any] = {}
        self.timeout_ms = max(int(timeout_s * 1000), 1)
        self._handles: dict[str, Any] = {}
        """Rendezvous handle per key: keeps the peers' mappings alive (peer tensors do not own them)."""
        self._targets: dict[str, tuple[torch.Tensor, ...]] = {}
        """Per key with a dump row: every rank's tensor including its dump row (`write_peer_rows`)."""
        self._keys: set[str] = set()
        disable_multicast()
        if symm_mem.get_backend(device) != "CUDA":
            symm_mem.set_backend("CUDA")  # raises if another backend already allocated in this process
        self._board = self._register(BOARD_KEY, torch.zeros(self.size, board_bytes, dtype=torch.uint8,
                                                            device=device))

    # -- small collectives ----------------------------------------------------------------------------------

    def barrier(self) -> None:
        """Device-side barrier on the current stream (no host sync, graph-capturable, self-resetting)."""
        self._handles[BOARD_KEY].barrier(channel=BARRIER_CHANNEL, timeout_ms=self.timeout_ms)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[*shape]` on every rank -> `[R, *shape]` (a fresh tensor): every rank writes its bytes into row
        `rank` of every peer's board, then copies its own board. Two barriers, R small peer copies."""
        if tensor.device != self.device:
            raise ValueError(f"rank {self.rank}: all_gather: tensor must be on {self.device}, got "
                             f"{tensor.device}")
        bytes_b = tensor.detach().contiguous().view(-1).view(torch.uint8)
        nbytes = bytes_b.numel()
        if nbytes > self._board.local.shape[1]:
            raise ValueError(f"rank {self.rank}: all_gather of {nbytes} bytes per rank exceeds the board's "
                             f"{self._board.local.shape[1]} (SymmetricWorld(board_bytes=...))")
        self.barrier()  # every rank has copied the previous gather out of its board
        for board in self._board.peers:
            board[self.rank, :nbytes].copy_(bytes_b)
        self.barrier()
        gathered = self._board.local[:, :nbytes].clone()
        return gathered.view(tensor.dtype).view(self.size, *tensor.shape)

    # -- symmetric tensors ----------------------------------------------------------------------------------

    def symmetric(self, key: str, tensor: torch.Tensor) -> SymmetricTensor:
        """Register `tensor` under `key`: moved into symmetric memory (contents copied, `tensor` re-pointed
        at it: views taken of it earlier keep the old memory) and mapped on every rank. Checks first that
        every rank registers the same key, shape and dtype (`check_same_registration`)."""
        if key in self._keys or key == BOARD_KEY:
            raise ValueError(f"symmetric key {key!r} is already registered on rank {self.rank}")
        if tensor.device != self.device:
            raise ValueError(f"symmetric key {key!r}: tensor must be on {self.device}, got {tensor.device}")
        if any(isinstance(value, PhysicalRows) for value in self.globals.values()):
            raise NotImplementedError(
                f"symmetric key {key!r}: the expert arena (transport.arena) joins home experts and slots in "
                "its own memory, which this world would move into symmetric memory, leaving the joined view "
                "stale; the weight pools must not use the arena with world='symmetric'")
        check_same_registration(self, key, tensor)
        return self._register(key, tensor)

    def _register(self, key: str, tensor: torch.Tensor) -> SymmetricTensor:
        """Allocate, rendezvous, map every peer, re-point `tensor`. Empty tensors need no memory: their peers
        are empty tensors."""
        self._keys.add(key)
        if tensor.numel() == 0:
            peers = tuple(tensor if r == self.rank else torch.empty_like(tensor) for r in range(self.size))
            return SymmetricTensor(key, self.rank, peers)
        rows = tensor.shape[0] if tensor.dim() else 0
        dump = tensor.dim() > 0 and tensor[0].nbytes <= DUMP_ROW_MAX_BYTES
        shape = (rows + 1, *tensor.shape[1:]) if dump else tuple(tensor.shape)
        memory = symm_mem.empty(shape, dtype=tensor.dtype, device=self.device)
        handle = symm_mem.rendezvous(memory, self.group)
        mapped = tuple(_peer_tensor(handle, r, memory) for r in range(self.size))
        local = memory[:rows] if dump else memory
        with torch.no_grad():
            local.copy_(tensor)
            tensor.set_(local)
        self._handles[key] = handle
        # every rank's initial contents land before any peer may write them (the H200 run without this
        # barrier lost a peer's first write to the receiver's late copy of its zeros)
        self.barrier()
        if dump:
            self._targets[key] = mapped
        peers = tuple(tensor if r == self.rank else (m[:rows] if dump else m) for r, m in enumerate(mapped))
        return SymmetricTensor(key, self.rank, peers)

    def release(self, key: str) -> None:
        """Collective: forget `key` (its handle, hence this process's mappings of the peers; `peers` of other
        ranks must not be used afterwards). The local memory lives as long as the registered tensor, and
        may be reused as soon as this returns.

        A barrier first, then a host wait for it: peers may still have kernels queued that read or write
        this rank's memory through their mappings (and this rank kernels that use its mappings of theirs);
        it returns once every rank's work queued before its `release` is done. A host sync: release
        outside a step (`destroy()`), on every rank, in the same order."""
        if key in self._handles:
            self.barrier()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        self._keys.discard(key)
        self._handles.pop(key, None)
        self._targets.pop(key, None)

    # -- row exchanges (gather_rows: PeerWorld) -------------------------------------------------------------

    def scatter_rows(self, target: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                     values_n: torch.Tensor, *, capacity: int | None = None) -> None:
        """Rank `rank_n[i]`'s `target` gets `values_n [n, *row]` at row `row_n[i]` (rank -1: ignored), written
        by this rank straight into the peers' memory, R * c rows (`write_peer_rows`); between barriers."""
        targets = self._targets.get(target.key)
        if targets is None:
            raise ValueError(f"rank {self.rank}: symmetric key {target.key!r} has no dump row (its rows are "
                             f"larger than DUMP_ROW_MAX_BYTES={DUMP_ROW_MAX_BYTES}, or it is empty or "
                             "0-dimensional): "
                             "it cannot be a scatter_rows target")
        local = target.local
        if targets[0].dtype != local.dtype or targets[0].shape[1:] != local.shape[1:]:
            # rows of another width over the registered memory (`SymmetricTensor.as_rows`): the dump row
            # is the row after them, inside the registered tensor and its dump row
            targets = tuple(reinterpret_rows(t, local.shape[0] + 1, local.shape[1], local.dtype)
                            for t in targets)
        self.barrier()  # every rank is done with the targets' previous contents
        write_peer_rows(targets, rank_n, row_n, values_n, capacity)
        self.barrier()  # every write into this rank's target has landed


def resolve_device(device: torch.device | str | None) -> torch.device:
    """This rank's GPU with its index: `device`, else `cuda:LOCAL_RANK` where set, else the current device.
    Raises ValueError where there is no CUDA or `device` is not a GPU."""
    if not torch.cuda.is_available():
        raise ValueError("world='symmetric' (the symmetric-memory EP world) needs CUDA: symmetric memory "
                         "maps peers' GPU memory; use world='collective' or 'threads' without a GPU")
    if device is None:
        local_rank = os.environ.get("LOCAL_RANK")
        device = int(local_rank) if local_rank is not None else torch.cuda.current_device()
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"world='symmetric' needs a CUDA device, got device={device}")
    return indexed_device(device)


def _peer_tensor(handle: Any, rank: int, memory: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s tensor matching `memory` (this rank's), as mapped in this process.

    `symm_mem.empty` may place several tensors in one allocation (its memory pool), so a handle's buffers
    start at the allocation and the tensor lies at an offset, the same on every rank. Newer torch has
    `get_remote_tensor` for exactly this; otherwise the offset is measured against this rank's buffer."""
    if hasattr(handle, "get_remote_tensor"):
        peer = handle.get_remote_tensor(rank, memory.shape, memory.dtype)
    else:
        offset = memory.data_ptr() - handle.buffer_ptrs[handle.rank]
        peer = handle.get_buffer(rank, memory.shape, memory.dtype, offset // memory.element_size())
    if rank == handle.rank and peer.data_ptr() != memory.data_ptr():
        raise RuntimeError(f"symmetric memory: this rank's mapping {peer.data_ptr():#x} is not its tensor "
                           f"{memory.data_ptr():#x} (unexpected handle layout in torch {torch.__version__})")
    return peer


# -- process groups ----------------------------------------------------------------------------------------


_worlds: dict[tuple[dist.ProcessGroup | None, torch.device], SymmetricWorld] = {}


def symmetric_world(group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                    **kwargs) -> SymmetricWorld:
    """This process's `SymmetricWorld` of `group` on `device` (one per pair, so that every layer shares its
    slot pools; `kwargs` go to the constructor when this creates it); `MoonEPMoELayer(config)` with
    `config.world == "symmetric"` uses the WORLD group's on the default device."""
    key = (group, resolve_device(device))
    if key not in _worlds:
        _worlds[key] = SymmetricWorld(group, key[1], **kwargs)
    return _worlds[key]


def init_symmetric(backend: str | None = None, *, init_method: str | None = None, rank: int | None = None,
                   world_size: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                   device: torch.device | str | None = None) -> SymmetricWorld:
    """Initialise the default process group (unless it is) with a timeout and return its symmetric world.

    Args:
        backend: of the process group ("nccl" default, "gloo" to share one GPU between ranks in tests).
        init_method, rank, world_size: as `torch.distributed.init_process_group`; the defaults read
            torchrun's environment (`env://`).
        timeout_s: the process group's timeout, and the world's barrier timeout.
        device: this rank's GPU (default `cuda:LOCAL_RANK`, else the current device).
    """
    disable_multicast()
    init_collective(backend, init_method=init_method, rank=rank, world_size=world_size, timeout_s=timeout_s)
    return symmetric_world(None, device, timeout_s=timeout_s)
