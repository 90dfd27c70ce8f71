"""`BufferPool`: Buffers of power-of-two token capacities for steps whose token count varies (serving).

A Buffer's shapes are fixed by its capacity S (rows `NvS` grow with S), and a decode step often carries a few
tokens per rank. The pool serves each step from the smallest Buffer that fits it:

1. `capacity_for(num_tokens)`: one small all-gather of every rank's token count; the capacity is the smallest
   power of two >= the group's maximum (at least `min_capacity`, at most `max_tokens_per_rank`), so every
   rank picks the same Buffer without a broadcast.
2. `get(num_tokens)`: that capacity's Buffer, created on first use (collective: every rank creates it in the
   same step, because every rank computed the same capacity).
3. `destroy()`: destroys every Buffer it created.

Memory: one Buffer per capacity used, at most `log2(S) + 1` of them; `stats()` reports each one's bytes.
The pool owns its Buffers (state); it holds no tensors itself.
"""

from __future__ import annotations

import torch

from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.world import EPWorld


def next_power_of_two(value: int) -> int:
    """Smallest power of two >= `value` (1 for `value` <= 1)."""
    return 1 << max(value - 1, 0).bit_length()


class BufferPool:
    """Lazily created Buffers of power-of-two capacities up to `max_tokens_per_rank` for one layer shape.

    Args:
        max_tokens_per_rank: S, the largest step (its Buffer has capacity S even when S is no power of two).
        hidden_size, top_k, num_experts: H, K, E. world: the EP world (R = world.size).
        num_slots: B prefetch slots per rank (default E / R). token_padding: tp. dtype: the rows' dtype.
        min_capacity: the smallest capacity served (default 1), to bound the number of Buffers.
        replica_cost: the planner's replication policy (`Buffer`'s argument; 0 = exact balance).
    """

    def __init__(self, max_tokens_per_rank: int, hidden_size: int, top_k: int, num_experts: int, *,
                 world: EPWorld, num_slots: int | None = None, token_padding: int = 128,
                 dtype: torch.dtype = torch.bfloat16, min_capacity: int = 1, replica_cost: int = 0):
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"rank {world.rank}: max_tokens_per_rank must be a positive int, got "
                             f"{max_tokens_per_rank!r}")
        if not isinstance(min_capacity, int) or not 1 <= min_capacity <= max_tokens_per_rank:
            raise ValueError(f"rank {world.rank}: min_capacity must be an int in [1, max_tokens_per_rank="
                             f"{max_tokens_per_rank}], got {min_capacity!r}")
        self.max_tokens_per_rank, self.min_capacity, self.world = max_tokens_per_rank, min_capacity, world
        self._shape = dict(H=hidden_size, K=top_k, E=num_experts, num_ep_ranks=world.size, B=num_slots,
                           token_padding=token_padding, replica_cost=replica_cost)
        self.dtype = dtype
        self._buffers: dict[int, Buffer] = {}
        self._destroyed = False

    def capacity_for(self, num_tokens: int) -> int:
        """Collective: the capacity every rank uses for a step where this rank has `num_tokens` tokens.

        One all-gather of one int per rank (a host read of `[R]` ints)."""
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= self.max_tokens_per_rank:
            raise ValueError(f"rank {self.world.rank}: num_tokens must be an int in [0, max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}], got {num_tokens!r}")
        count = torch.tensor(num_tokens, dtype=torch.int64, device=self.world.device)
        counts_r = self.world.all_gather(count)
        group_max = int(counts_r.max())
        return min(next_power_of_two(max(group_max, self.min_capacity)), self.max_tokens_per_rank)

    def get(self, num_tokens: int) -> Buffer:
        """Collective: the Buffer of `capacity_for(num_tokens)`, created on first use."""
        if self._destroyed:
            raise RuntimeError(f"rank {self.world.rank}: this BufferPool was destroyed; create a new one")
        capacity = self.capacity_for(num_tokens)
        if capacity not in self._buffers:
            self._buffers[capacity] = Buffer(capacity, **self._shape, explicitly_destroy=True,
                                             world=self.world, dtype=self.dtype)
        return self._buffers[capacity]

    def stats(self) -> dict[str, object]:
        """`capacities` created (ascending), `rows_per_rank` (NvS) and `bytes` of each on this rank, and
        `total_bytes`."""
        capacities = sorted(self._buffers)
        nbytes = [self._buffers[c].nbytes for c in capacities]
        return dict(capacities=capacities, rows_per_rank=[self._buffers[c].NvS for c in capacities],
                    bytes=nbytes, total_bytes=sum(nbytes))

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """Destroy every Buffer of the pool. Idempotent; a later `get` raises."""
        for buffer in self._buffers.values():
            buffer.destroy()
        self._buffers.clear()
        self._destroyed = True
