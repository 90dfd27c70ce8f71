"""The peer exchange: what worlds whose symmetric tensors map every peer share.

Worlds whose symmetric tensors map every peer (threads here, symmetric memory in `transport.symmetric`) share
one peer exchange: `PeerWorld.gather_rows` reads peers' rows directly (`read_peer_rows`), and a world whose
targets carry a dump row writes peers' rows directly (`write_peer_rows`: the symmetric world allocates its
tensors, dump row included; the threads world registers the caller's tensors as they are, so its
`scatter_rows` stays receiver-side). Both move `R * c` rows per rank (c = the call's `capacity`), with each
rank's entries grouped by peer (`entries_by_rank`); nothing reads a device value on the host.
"""

from __future__ import annotations

import torch

from moonep_moe.transport.world import SymmetricTensor


class PeerWorld:
    """What worlds whose `SymmetricTensor`s map every peer share: `gather_rows` reads peers' rows directly.

    A mixin for `EPWorld` implementations: subclasses provide `size` and `barrier()` (which must order each
    rank's earlier work before every rank's later work). Not an nn.Module; owns nothing.
    """

    size: int

    def barrier(self) -> None:
        raise NotImplementedError

    def gather_rows(self, source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor, *,
                    capacity: int | None = None) -> torch.Tensor:
        """`[n, *row]` rows `source.peer(rank_n[i])[row_n[i]]`, zero where `rank_n[i]` is -1, read directly
        from the peers (`read_peer_rows`, `R * capacity` row reads); between two barriers."""
        self.barrier()  # every rank's source is final
        rows = read_peer_rows(source, rank_n, row_n, capacity)
        self.barrier()  # every rank is done reading this rank's source
        return rows


def order_by_rank(rank_n: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order `[n]` of the entries by rank (rank -1 last), and the entries per rank `[R + 1]` (the last
    counts rank -1). No host read."""
    key_n = torch.where(rank_n >= 0, rank_n, size)
    count_r = torch.zeros(size + 1, dtype=torch.int64, device=rank_n.device)
    count_r.scatter_add_(0, key_n, torch.ones_like(key_n))
    return torch.argsort(key_n, stable=True), count_r


def entries_by_rank(rank_n: torch.Tensor, size: int, capacity: int | None) -> torch.Tensor:
    """`[R, c]` int64: row d lists the entries (indices into `rank_n [n]`) addressed to rank d, in order,
    then n (no entry) in the slots left over; c = min(capacity, n) (capacity None = n). Entries beyond the
    capacity are left out: the capacity is the caller's promise (nothing here reads the device to check
    it). Fixed shapes, no host read."""
    n = len(rank_n)
    c = n if capacity is None else min(capacity, n)
    rank_n = rank_n.long()
    order_n, count_r = order_by_rank(rank_n, size)
    start_r = torch.cumsum(count_r, 0) - count_r
    slot_c = torch.arange(c, device=rank_n.device)
    position_rc = start_r[:size, None] + slot_c
    real_rc = slot_c < count_r[:size, None]
    entry_rc = order_n.index_select(0, position_rc.clamp(max=max(n - 1, 0)).view(-1)).view(size, c)
    return torch.where(real_rc, entry_rc, n)


def read_peer_rows(source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                   capacity: int | None = None) -> torch.Tensor:
    """`[n, *row]`: row `row_n[i]` of `source.peer(rank_n[i])`, a zero row where `rank_n[i]` is -1. Per peer,
    one fixed-shape `[c]` read of its rows and one local write of them (c from `capacity`, as in
    `entries_by_rank`); slots without an entry read row 0 into a dump row that is cut off. The caller orders
    it between barriers."""
    local = source.local
    n = len(rank_n)
    rows = local.new_zeros((n + 1, *local.shape[1:]))  # row n: the dump of the slots without an entry
    if n and local.shape[0]:
        entry_rc = entries_by_rank(rank_n, len(source.peers), capacity)
        row_n = row_n.long()
        for rank, entry_c in enumerate(entry_rc):
            read_c = torch.where(entry_c < n, row_n.index_select(0, entry_c.clamp(max=n - 1)), 0)
            rows.index_copy_(0, entry_c, source.peer(rank).index_select(0, read_c))
    return rows[:n]


def write_peer_rows(targets: tuple[torch.Tensor, ...], rank_n: torch.Tensor, row_n: torch.Tensor,
                    values_n: torch.Tensor, capacity: int | None = None) -> None:
    """`targets[rank_n[i]][row_n[i]] = values_n[i]` for every entry with rank >= 0, written straight into the
    peers' memory: per peer one fixed-shape `[c]` write (c from `capacity`). `targets[r]` is rank r's tensor
    with one extra last row, the dump row, which takes the writes of the slots without an entry (so no
    write needs a mask and no two writers race on a real row). The caller orders it between barriers."""
    n = len(rank_n)
    if not n:
        return
    dump = targets[0].shape[0] - 1
    entry_rc = entries_by_rank(rank_n, len(targets), capacity)
    row_n = row_n.long()
    for target, entry_c in zip(targets, entry_rc, strict=True):
        entry_c, real_c = entry_c.clamp(max=n - 1), entry_c < n
        target.index_copy_(0, torch.where(real_c, row_n.index_select(0, entry_c), dump),
                           values_n.index_select(0, entry_c).to(target.dtype))


def place_rows(target: torch.Tensor, rows_m: torch.Tensor, values_m: torch.Tensor) -> None:
    """`target[rows_m[i]] = values_m[i]` for every `rows_m[i] >= 0` (`[m]` rows, `[m, *row]` values), with
    fixed shapes and no host read: entries of -1 rewrite the first real entry's row with its own value (or
    row 0 with itself when none is real), so every repeated write carries identical bytes. Only the owner
    of `target` may call it while peers could write it (the rewrite of row 0 reads it first)."""
    if not len(rows_m) or not target.shape[0]:
        return
    real_m = rows_m >= 0
    first_1 = torch.argmax(real_m.to(torch.uint8)).view(1)
    fill_row_1 = rows_m.index_select(0, first_1).clamp(min=0)
    expand = (-1,) + (1,) * (values_m.dim() - 1)
    fill_value_1 = torch.where(real_m.index_select(0, first_1).view(expand),
                               values_m.index_select(0, first_1), target.index_select(0, fill_row_1))
    target.index_copy_(0, torch.where(real_m, rows_m, fill_row_1),
                       torch.where(real_m.view(expand), values_m, fill_value_1))
