"""Row-kernel micro-benchmark: the comm core's Triton kernels against the device copy bandwidth.

One GPU. Rank 0 of an R-rank group is simulated: the R ranks' symmetric tensors all live on this GPU, so
every "peer" access is a local one and the numbers are the kernels' own bandwidth (NVLink is not measured
here; bench/comm.py runs whole groups). Routing is uniform over E experts (each token's K experts distinct).

- `send_routes` (dispatch's peer phase): reads S token rows, writes one row per (token, destination rank);
- `gather_routes` (combine's peer phase): reads the same rows back, writes S rows (fp32 k-order sums);
- combine's local phase (expert outputs not in the Buffer's rows), `copy_rows` then `pre_reduce_duplicates`
  (`two_pass_pre_reduce`), on rank 0's dup tables of the same uniform routing (every rank routes like rank
  0), counting the bytes it moves;
- `copy_experts` (prefetch, ExpertRows): the used slots of B of a `[H, H']` bf16 projection from their home
  ranks, a skewed plan's and one slot alone (`_one_slot`: what a real plan fills on a rank);
- `add_replicas` (reduce_grad): the fp32 gradients of the home experts with replicas plus their replicas'
  (the same two plans);
- `buffer_dispatch` / `buffer_combine`: whole one-rank Buffer operations, kernels vs the torch reference.

Bandwidth = bytes read + written / time, as a fraction of `limits.copy_bytes_per_s` (a 4 GiB `copy_`). The
kernels' `seconds` are device time (`bench.common.graph_timed`: calls replayed in a CUDA graph), the 80%
target's measure; `eager_seconds` times one eager call with events and so also counts the host's launch
when it is longer than the GPU's queue (Triton's launcher: tens of microseconds). The whole Buffer
operations on the torch reference are timed eagerly only (not capturable).
`--row-block-bytes` times the peer phases and combine's local phase once per largest row block
(`rows.ROW_BLOCK_BYTES`); the other operations run with the package's setting.

    python -m bench.rows                       # S=8192 H=7168 K=8 E=384 R=8 H'=2048
    python -m bench.rows --row-block-bytes 4096 8192 16384

Writes `bench/results/rows-<device>-<date>-<commit>.json`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.common import graph_timed, measure_limits, timed, write_record
from moonep_moe.base.sizes import default_slots, rows_capacity
from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.exchange import primary_rows, replica_sources
from moonep_moe.comm.kernels import experts, rows
from moonep_moe.plan.planner import plan_routes
from moonep_moe.plan.types import decode_dst
from moonep_moe.transport.threads import single_world
from moonep_moe.transport.world import SymmetricTensor


def symmetric(key: str, tensors: list[torch.Tensor]) -> SymmetricTensor:
    """Rank 0's view of R tensors on this GPU (a simulated group: no world, no barrier)."""
    return SymmetricTensor(key, 0, tuple(tensors))


def routing(S: int, K: int, E: int, R: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_sk` of rank 0 and a group histogram `[R, E]` (every rank routes like rank 0)."""
    p_e = torch.ones(E, device="cuda")
    if skewed:
        p_e[E // R:] = 0.02
    topk_sk = torch.multinomial(p_e.expand(S, -1), K).int()
    counts_e = torch.bincount(topk_sk.view(-1).long(), minlength=E)
    return topk_sk, counts_e.expand(R, -1).contiguous()


def peer_phases(record, S: int, H: int, K: int, E: int, R: int, B: int, nvs: int) -> None:
    """Dispatch's and combine's peer phases on rank 0 of R (uniform routing)."""
    topk_sk, counts_re = routing(S, K, E, R, skewed=False)
    plan = plan_routes(counts_re, topk_sk, rank=0, num_slots=B, token_padding=128, rows_per_rank=nvs)
    hidden_sh = torch.randn(S, H, device="cuda").bfloat16()
    weights_sk = torch.rand(S, K, device="cuda")
    peers = symmetric("rows", [torch.zeros(nvs, H, dtype=torch.bfloat16, device="cuda") for _ in range(R)])
    weights = symmetric("weights", [torch.zeros(nvs, device="cuda") for _ in range(R)])
    pairs = symmetric("dup_pairs", [torch.full((R * S * K, 2), -1, dtype=torch.int32, device="cuda")
                                    for _ in range(R)])
    _, _, primary_n, valid_n = decode_dst(plan.dst, nvs)
    moved = (S + int((primary_n & valid_n).sum())) * H * 2  # token rows read + payload rows written
    record("send_routes", lambda: rows.send_routes(hidden_sh, weights_sk, plan.dst, False, peers, weights,
                                                   pairs), moved)
    out_sh = torch.empty(S, H, dtype=torch.bfloat16, device="cuda")
    record("gather_routes", lambda: rows.gather_routes(plan.dst, peers, None, out_sh, None, torch.float32),
           moved)


def combine_rows(record, S: int, H: int, K: int, E: int, R: int, B: int, nvs: int) -> None:
    """Combine's local phase on rank 0 of R (uniform routing, every rank routing like rank 0): the expert
    outputs into the Buffer's rows, then duplicate groups summed into their primaries."""
    topk_sk, counts_re = routing(S, K, E, R, skewed=False)
    kwargs = dict(num_slots=B, token_padding=128, rows_per_rank=nvs)
    plan = plan_routes(counts_re, topk_sk, rank=0, **kwargs)
    pairs_p2 = torch.full((R * S * K, 2), -1, dtype=torch.int32, device="cuda")  # what rank 0 receives
    for rank in range(R):
        dst_n = plan.dst if rank == 0 else plan_routes(counts_re, topk_sk, rank=rank, **kwargs).dst
        dest_n, row_n, primary_n, valid_n = decode_dst(dst_n, nvs)
        dup_n = valid_n & ~primary_n & (dest_n == 0)
        pairs_n2 = torch.stack([row_n.int(), primary_rows(dst_n, nvs, K)], 1)
        pairs_p2[rank * S * K:(rank + 1) * S * K] = torch.where(dup_n[:, None], pairs_n2, -1)
    marks_nvs = torch.zeros(nvs, dtype=torch.int32, device="cuda")
    end_1, tables = plan.cu_seqlens[-1:], (plan.dup_groups, plan.dup_loffs, plan.dup_counts)
    rows.record_duplicates(pairs_p2, marks_nvs, end_1, *tables, K)
    rows_nvsh = torch.zeros(nvs, H, dtype=torch.bfloat16, device="cuda")
    expert_out_nvsh = torch.randn(nvs, H, device="cuda").bfloat16()
    filled, (groups, duplicates) = int(end_1[0]), plan.dup_counts.tolist()
    row_bytes = H * 2

    def two_pass() -> None:
        rows.copy_rows(rows_nvsh, expert_out_nvsh, end_1)
        rows.pre_reduce_duplicates(rows_nvsh, *tables, K - 1, min(nvs // 2, R * S), torch.float32)

    # every filled row read and written, then each group's rows read and its primary written
    record("two_pass_pre_reduce", two_pass, (2 * filled + 2 * groups + duplicates) * row_bytes)


def weight_phases(record, S: int, H: int, K: int, E: int, R: int, B: int, nvs: int, ffn: int) -> None:
    """prefetch's and reduce_grad's peer phases on rank 0 of R (skewed routing: slots in use)."""
    topk_sk, counts_re = routing(S, K, E, R, skewed=True)
    plan = plan_routes(counts_re, topk_sk, rank=0, num_slots=B, token_padding=128, rows_per_rank=nvs)
    epn, row = E // R, (H, ffn)
    home = symmetric("home", [torch.randn(epn, *row, device="cuda").bfloat16() for _ in range(R)])
    slots_bx = torch.empty(B, *row, dtype=torch.bfloat16, device="cuda")
    grads = torch.zeros(epn, *row, device="cuda")
    slot_grads = symmetric("slot_grads", [torch.zeros(B, *row, device="cuda") for _ in range(R)])
    # this skewed plan's slots, and one slot alone: what a real plan of a group fills on a rank (one or two of
    # its B slots), where the kernels' cost is what the unused slots and experts cost
    one_rb = torch.full_like(plan.experts_to_copy, -1)
    one_rb[0, B // 2], one_rb[1, B // 2] = epn, 0  # rank 1's first expert here, one of ours on rank 1
    for tag, table_rb in (("", plan.experts_to_copy), ("_one_slot", one_rb)):
        experts_b = table_rb[0]
        used = int((experts_b >= 0).sum())  # only used slots are read and written
        record(f"copy_experts{tag}", lambda experts_b=experts_b: experts.copy_experts(
            home, slots_bx, experts_b), 2 * used * slots_bx[0].nbytes)
        table_rb = table_rb.long()
        mine_rb, home_rb = (table_rb >= 0) & (table_rb // epn == 0), table_rb.clamp(min=0) % epn
        sources_hr = replica_sources(mine_rb, home_rb, epn)
        homes = int((sources_hr[:, 0] >= 0).sum())  # home experts with replicas: read, written, replicas read
        record(f"add_replicas{tag}", lambda sources_hr=sources_hr: experts.add_replicas(grads, slot_grads,
                                                                                       sources_hr),
               (2 * homes + int(mine_rb.sum())) * grads[0].nbytes)


def buffer_ops(record, S: int, H: int, K: int, E: int) -> None:
    """Whole one-rank Buffer operations (all K routes local: K - 1 duplicates per token), kernels vs the
    torch reference. Bytes counted: S token rows and S*K routed rows (an approximation of the traffic)."""
    world = single_world("cuda")
    topk_sk, _ = routing(S, K, E, 1, skewed=False)
    tpe = torch.bincount(topk_sk.view(-1).long(), minlength=E).int()
    hidden_sh = torch.randn(S, H, device="cuda").bfloat16()
    weights_sk = torch.rand(S, K, device="cuda")
    for kernels in (True, False):
        buf = Buffer(S, H, K, E, 1, world=world, validate=False, kernels=kernels)
        *_, plan = buf.dispatch(hidden_sh, weights_sk, topk_sk, tpe, zero_copy=True)
        tag = "kernels" if kernels else "reference"
        record(f"dispatch_{tag}", lambda buf=buf, plan=plan: buf.dispatch(
            hidden_sh, None, None, None, plan=plan, zero_copy=True), (S + S * K) * H * 2, capturable=kernels)
        record(f"combine_{tag}", lambda buf=buf, plan=plan: buf.combine(
            plan, buf.hidden_nvsh_buffer_view, zero_copy=True), (S * K + S) * H * 2, capturable=kernels)
        buf.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--S", type=int, default=8192)
    parser.add_argument("--H", type=int, default=7168)
    parser.add_argument("--K", type=int, default=8)
    parser.add_argument("--E", type=int, default=384)
    parser.add_argument("--R", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--row-block-bytes", type=int, nargs="+", default=[rows.ROW_BLOCK_BYTES])
    args = parser.parse_args()
    S, H, K, E, R = args.S, args.H, args.K, args.E, args.R
    B = default_slots(E, R)
    nvs = rows_capacity(S, K, R, E, B, 128)
    limits = measure_limits()
    results = []

    def record(name: str, fn: Callable[[], object], nbytes: int, capturable: bool = True) -> None:
        eager_s = timed(fn)
        seconds = graph_timed(fn) if capturable else eager_s
        fraction = nbytes / seconds / limits["copy_bytes_per_s"]
        results.append({"op": name, "row_block_bytes": rows.ROW_BLOCK_BYTES, "seconds": seconds,
                        "eager_seconds": eager_s, "bytes": nbytes, "bytes_per_s": nbytes / seconds,
                        "fraction_of_copy": fraction})
        print(f"{name:20s} {rows.ROW_BLOCK_BYTES:6d} {seconds * 1e6:9.1f} us (eager {eager_s * 1e6:7.1f})  "
              f"{nbytes / seconds / 1e12:6.2f} TB/s  {fraction:.0%} of copy")

    default = rows.ROW_BLOCK_BYTES
    for block_bytes in args.row_block_bytes:
        rows.ROW_BLOCK_BYTES = block_bytes
        peer_phases(record, S, H, K, E, R, B, nvs)
        combine_rows(record, S, H, K, E, R, B, nvs)
    rows.ROW_BLOCK_BYTES = default
    weight_phases(record, S, H, K, E, R, B, nvs, args.ffn)
    buffer_ops(record, S, H, K, E)
    print(f"wrote {write_record('rows', limits, results)}")


if __name__ == "__main__":
    main()
