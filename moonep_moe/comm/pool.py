"""Buffers with several users: `BufferPool`, Buffers of power-of-two token capacities for steps whose token
count varies (serving); `layer_buffer`, the one Buffer of a layer shape that a model's layers share.

A Buffer's shapes are fixed by its capacity S (rows `NvS` grow with S), and a decode step often carries a few
tokens per rank. The pool serves each step from the smallest Buffer that fits it:

1. `capacity_for(num_tokens)`: one small all-gather of every rank's token count; the capacity is the smallest
   power of two >= the group's maximum (at least `min_capacity`, at most `max_tokens_per_rank`), so every
   rank picks the same Buffer without a broadcast. That gather is read on the host (a sync on a GPU); an
   engine that pads its batches to buckets (CUDA graphs) names the bucket instead: `get(num_tokens,
   capacity=bucket)` reads nothing on the host (every rank must name the same bucket). With one capacity
   (`min_capacity` reaching `max_tokens_per_rank`: the communicator's `variable_tokens=False`) nothing is
   gathered either.
2. `get(num_tokens)`: a Buffer of that capacity with no step in flight, created on first use (collective:
   every rank creates it in the same step, because every rank computed the same capacity and has the same
   steps in flight). Up to `max_inflight_steps` Buffers per capacity, so that many steps (two-batch overlap:
   two) may be dispatched and not yet combined at once; the i-th step in flight uses the i-th Buffer.
3. `destroy()`: destroys every Buffer it created.

Memory: up to `max_inflight_steps` Buffers per capacity used, at most `log2(S) + 1` capacities; `stats()`
reports each one's bytes. The pool owns its Buffers (state); it holds no tensors itself.
"""

from __future__ import annotations

import torch

from moonep_moe.base.sizes import TOKEN_PADDING, next_power_of_2
from moonep_moe.comm.buffer import Buffer
from moonep_moe.transport.world import EPWorld


def layer_buffer(world: EPWorld, S: int, H: int, K: int, E: int, B: int, *, token_padding: int,
                 dtype: torch.dtype, replica_cost: int) -> Buffer:
    """The Buffer (`validate=False`) that every layer of this shape on `world` shares, as they share the
    prefetch-slot pools: made by the first call (collective: every rank builds its layers in the same
    order), each call one more user; give each back with `release_layer_buffer`. Layers may share it because
    each routed step (a forward, or a backward) starts with its own dispatch and ends with its combine, and
    a backward `dispatch(plan=...)` makes its layer's plan the Buffer's latest again.

    The key is every argument the Buffer is built with, so layers share it only where their plans and rows
    are the same: a layer of another balance policy (`replica_cost`) gets a Buffer of its own. A Buffer
    destroyed directly (`buffer.destroy()`, not given back) is replaced, never handed out."""
    args = dict(S=S, H=H, K=K, E=E, num_ep_ranks=world.size, B=B, token_padding=token_padding, dtype=dtype,
                replica_cost=replica_cost)
    key = ("layer_buffer", *args.items())
    shared = world.globals.get(key)
    if shared is None or shared[0].destroyed:
        shared = world.globals[key] = [Buffer(**args, world=world, validate=False), 0]
    shared[1] += 1
    return shared[0]


def release_layer_buffer(world: EPWorld, buffer: Buffer) -> None:
    """One user of a `layer_buffer` fewer: the last one destroys it (collective, like its making)."""
    for key, shared in list(world.globals.items()):
        if isinstance(key, tuple) and key[0] == "layer_buffer" and shared[0] is buffer:
            shared[1] -= 1
            if shared[1] == 0:
                del world.globals[key]
                buffer.destroy()
            return
    if not buffer.destroyed:  # a destroyed one was replaced (someone destroyed it directly): nothing to do
        raise ValueError(f"rank {world.rank}: Buffer {buffer.id} is not a layer Buffer of this world")


class BufferPool:
    """Lazily created Buffers of power-of-two capacities up to `max_tokens_per_rank` for one layer shape.

    Args:
        max_tokens_per_rank: S, the largest step (its Buffer has capacity S even when S is no power of two).
        hidden_size, top_k, num_experts: H, K, E. world: the EP world (R = world.size).
        num_slots: B prefetch slots per rank (default E / R). token_padding: tp. dtype: the rows' dtype.
        min_capacity: the smallest capacity served (default 1), to bound the number of Buffers.
        replica_cost: the planner's replication policy (`Buffer`'s argument; 0 = exact balance).
        max_inflight_steps: Buffers per capacity: steps that may be in flight (dispatched, not combined) at
            once on one capacity (default 1; 2 for two-batch overlap).
        validate: the Buffers' `validate` (expert-id checks read on the host: a sync on a GPU).
    """

    def __init__(self, max_tokens_per_rank: int, hidden_size: int, top_k: int, num_experts: int, *,
                 world: EPWorld, num_slots: int | None = None, token_padding: int = TOKEN_PADDING,
                 dtype: torch.dtype = torch.bfloat16, min_capacity: int = 1, max_inflight_steps: int = 1,
                 validate: bool = True, replica_cost: int = 0):
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"rank {world.rank}: max_tokens_per_rank must be a positive int, got "
                             f"{max_tokens_per_rank!r}")
        if not isinstance(min_capacity, int) or not 1 <= min_capacity <= max_tokens_per_rank:
            raise ValueError(f"rank {world.rank}: min_capacity must be an int in [1, max_tokens_per_rank="
                             f"{max_tokens_per_rank}], got {min_capacity!r}")
        if not isinstance(max_inflight_steps, int) or max_inflight_steps < 1:
            raise ValueError(f"rank {world.rank}: max_inflight_steps must be a positive int, got "
                             f"{max_inflight_steps!r}")
        self.max_tokens_per_rank, self.min_capacity, self.world = max_tokens_per_rank, min_capacity, world
        self.max_inflight_steps = max_inflight_steps
        self._shape = dict(H=hidden_size, K=top_k, E=num_experts, num_ep_ranks=world.size, B=num_slots,
                           token_padding=token_padding, validate=validate, replica_cost=replica_cost)
        self.dtype = dtype
        self._buffers: dict[int, list[Buffer]] = {}
        self._destroyed = False

    @property
    def capacities(self) -> list[int]:
        """Every capacity the pool may serve, ascending: the powers of two from `min_capacity`'s up to
        `max_tokens_per_rank` (exclusive), then `max_tokens_per_rank` (an engine's batch-size buckets)."""
        smallest = next_power_of_2(self.min_capacity)
        powers = [1 << i for i in range(smallest.bit_length() - 1, self.max_tokens_per_rank.bit_length())]
        return [c for c in powers if c < self.max_tokens_per_rank] + [self.max_tokens_per_rank]

    def capacity_for(self, num_tokens: int) -> int:
        """Collective: the capacity every rank uses for a step where this rank has `num_tokens` tokens.

        One all-gather of one int per rank (a host read of `[R]` ints; none with one rank)."""
        self._check_tokens(num_tokens)
        group_max = num_tokens
        if self.world.size > 1:
            count = torch.tensor(num_tokens, dtype=torch.int64, device=self.world.device)
            group_max = int(self.world.all_gather(count).max())
        return min(next_power_of_2(max(group_max, self.min_capacity)), self.max_tokens_per_rank)

    def get(self, num_tokens: int, capacity: int | None = None) -> Buffer:
        """Collective: a Buffer of `capacity` (None: `capacity_for(num_tokens)`) with no step in flight,
        created on first use.

        Args:
            num_tokens: this rank's tokens in the step, at most the capacity.
            capacity: the bucket, one of `capacities`, the same on every rank (not checked: that would be a
                host read). Required while a CUDA graph is being captured, unless there is one bucket.

        Raises:
            RuntimeError: `max_inflight_steps` steps of this capacity are in flight already.
        """
        if self._destroyed:
            raise RuntimeError(f"rank {self.world.rank}: this BufferPool was destroyed; create a new one")
        capacity = self._bucket(num_tokens, capacity)
        buffers = self._buffers.setdefault(capacity, [])
        buffers[:] = [buffer for buffer in buffers if not buffer.destroyed]  # destroyed directly: dropped
        free = [buffer for buffer in buffers if buffer._pending_views is None]
        if free:
            return free[0]
        if len(buffers) == self.max_inflight_steps:
            raise RuntimeError(
                f"rank {self.world.rank}: {len(buffers)} steps of capacity {capacity} are in flight "
                f"(dispatched, not combined) and max_inflight_steps={self.max_inflight_steps}: combine (or "
                "discard) one first, or allow more in-flight steps")
        buffers.append(Buffer(capacity, **self._shape, explicitly_destroy=True, world=self.world,
                              dtype=self.dtype))
        return buffers[-1]

    def _check_tokens(self, num_tokens: int) -> None:
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= self.max_tokens_per_rank:
            raise ValueError(f"rank {self.world.rank}: num_tokens must be an int in [0, max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}], got {num_tokens!r}")

    def _bucket(self, num_tokens: int, capacity: int | None) -> int:
        """The capacity serving the step: `capacity` checked against the buckets and `num_tokens` (host ints
        only); where there is one bucket (`min_capacity` reaches `max_tokens_per_rank`), that one, read from
        nothing; else `capacity_for(num_tokens)` outside a CUDA graph's capture."""
        rank, buckets = self.world.rank, self.capacities
        if capacity is None and len(buckets) == 1:  # one Buffer serves every step: nothing to gather
            capacity = buckets[0]
        if capacity is None:
            if self.world.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"rank {rank}: capacity must be given while a CUDA graph is being captured "
                                 "(choosing it from the group's token counts reads them on the host): pass "
                                 f"the bucket, one of {buckets}")
            return self.capacity_for(num_tokens)
        self._check_tokens(num_tokens)
        if capacity not in buckets or num_tokens > capacity:
            raise ValueError(f"rank {rank}: capacity must be one of {buckets} and >= the step's "
                             f"{num_tokens} tokens, got {capacity!r}")
        return capacity

    def stats(self) -> dict[str, object]:
        """`capacities` created (ascending, once per Buffer: `max_inflight_steps` Buffers of one capacity
        appear that many times), `rows_per_rank` (NvS) and `bytes` of each on this rank, and `total_bytes`."""
        buffers = [buffer for capacity in sorted(self._buffers) for buffer in self._buffers[capacity]
                   if not buffer.destroyed]
        nbytes = [buffer.nbytes for buffer in buffers]
        return dict(capacities=[buffer.S for buffer in buffers],
                    rows_per_rank=[buffer.NvS for buffer in buffers], bytes=nbytes, total_bytes=sum(nbytes))

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """Destroy every Buffer of the pool. Idempotent; a later `get` raises."""
        for buffers in self._buffers.values():
            for buffer in buffers:
                buffer.destroy()
        self._buffers.clear()
        self._destroyed = True
