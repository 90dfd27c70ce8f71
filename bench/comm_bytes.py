"""Bytes one rank sends to other ranks per layer and step, by operation, in the collective EP world.

Run `python bench/comm_bytes.py` to print the README table ("Beyond one NVLink domain") for every packaged
layer config, with replicas (B = epn, training) and without (B = 0, plain EP). Pure arithmetic, no torch ops.

Symbols (DESIGN.md): S tokens per rank, K top-k, H hidden, H' expert FFN width, E experts, R ranks,
B slots per rank; a bytes per activation/weight element (2 for bf16), 4 for fp32 route weights and
gradients, 8 per int64 row index. Only bytes leaving the rank for the R - 1 others count (the block a rank
sends itself never crosses the network); a rank receives as much as it sends in the static mode.

Static mode (the default, no host sync): every exchange sends each peer a fixed block of c rows plus c row
indices, whatever the routing (c: at most S payload rows per peer, since a token's row reaches each rank
once; S*K route weights and duplicate sources; B expert rows):
- dispatch (forward)  = (R-1) * [S*(H*a + 8) + 2 * S*K*(4 + 8)]    rows, route weights, duplicate sources
- dispatch (backward) = (R-1) * S*(H*a + 8)                         the output gradient's rows
- dispatch, FP8       = the same with H*a replaced by P = packed_width(H), the e4m3 bytes and their 1x128
                        fp32 scales in one row: align16(align4(H) + 4*ceil(H/128)) (`fp8.wire`)
- combine (forward)   = (R-1) * S*(8 + H*a)                         row requests, then the replies
- combine (backward)  = (R-1) * [S*(8 + H*a) + S*K*(8 + 4)]         + the route-weight gradients
- prefetch            = (R-1) * B*(8 + 3*H*H'*a)                    gate, up and down of an expert
- prefetch, FP8       = (R-1) * B*(8 + 3*H*H' + 3*4*ceil(H/128)*ceil(H'/128))   e4m3 bytes and fp32 scales
- reduce_grad         = (R-1) * B*(8 + 3*H*H'*g)                    slot gradients, g bytes each
                        (`MoEConfig.replica_grad_dtype`: a with the default "param" gradients, written
                        over the slot weights; 4, fp32, with "main_grad")

Exact-size mode (`CollectiveWorld(exact_size=True)`: real rows only, plus 2R counts read on the host):
with M remote payload rows, W remote route weights and D = W - M remote duplicate sources, the rows terms
become M*(H*a + 8), the route-weight terms W*(4 + 8), the duplicate term D*(4 + 8), and prefetch and
reduce_grad move only the slots in use.
- worst case (every route remote, a token's K routes on min(K, R-1) other ranks, every slot used):
  M = S*min(K, R-1), W = S*K, slots used = B;
- uniform routing (each route remote with probability (R-1)/R): M = S*(R-1)*(1 - (1 - 1/R)^K),
  W = S*K*(R-1)/R, and the planner replicates almost nothing (the CPU demo: 0-2 slots per rank), counted
  here as one slot per rank.

A training step of one layer = dispatch and combine in forward and backward, prefetch twice (the slot pool is
shared by layers, so backward prefetches again), reduce_grad once. The FP8 dispatch (`dispatch(...,
scales=)`: e4m3 rows with one fp32 scale per 128 columns, `moonep_moe.fp8.wire`) and the FP8 prefetch
(`prefetch_weight(..., scales=)`: FP8 experts with one fp32 scale per 128x128 block,
`moonep_moe.fp8.format`) are columns of their own, beside the bf16 ones they would replace: about half
their bytes (not in the training step's sum; both columns count FP8 both ways, where a layer's backward
dispatch would carry bf16 gradients). The scales' overhead over the e4m3 bytes: 4/128 = 3.1% of a row
(DeepSeek-V3's H = 7168: 7392 bytes against bf16's 14336, 51.6%; plus 8 per row index and the unchanged
route-weight terms), and 4/128^2 = 0.02% of an expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_moe.config import MoEConfig, available_configs, load_config
from moonep_moe.fp8.format import BLOCK
from moonep_moe.fp8.wire import packed_width

INDEX = 8
"""Bytes per row index (int64) sent alongside every row."""
FP32 = 4
OPS = ("dispatch", "combine", "prefetch", "reduce_grad")
"""The operations of a training step (summed in its column); `traffic` also gives "dispatch fp8" and
"prefetch fp8"."""
MODES = ("static", "exact, worst", "exact, uniform")


@dataclass(frozen=True)
class Shape:
    S: int
    K: int
    H: int
    F: int
    E: int
    R: int
    B: int
    a: int
    g: int
    """Bytes of a slot gradient's element (`MoEConfig.replica_grad_dtype`)."""

    @classmethod
    def of(cls, cfg: MoEConfig, B: int) -> Shape:
        return cls(cfg.max_tokens_per_rank, cfg.top_k, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts,
                   cfg.ep_size, B, cfg.torch_dtype.itemsize, cfg.replica_grad_dtype.itemsize)


def traffic(rows: float, weights: float, dups: float, slots: float,
            s: Shape) -> dict[str, tuple[float, float]]:
    """(forward, backward) bytes per operation, given the payload rows, route weights, duplicate sources and
    slots one exchange sends to other ranks (prefetch: forward and backward; reduce_grad: backward only);
    "dispatch fp8": the dispatch of packed FP8 rows (e4m3 bytes and 1x128 fp32 scales, `packed_width`);
    "prefetch fp8": the prefetch of FP8 experts (1 byte per element, an fp32 scale per 128x128 block)."""
    row, weight, expert = s.H * s.a + INDEX, FP32 + INDEX, 3 * s.H * s.F
    row_fp8 = packed_width(s.H) + INDEX
    expert_fp8 = expert + 3 * FP32 * -(-s.H // BLOCK) * -(-s.F // BLOCK)
    return {"dispatch": (rows * row + (weights + dups) * weight, rows * row),
            "dispatch fp8": (rows * row_fp8 + (weights + dups) * weight, rows * row_fp8),
            "combine": (rows * row, rows * row + weights * weight),
            "prefetch": (slots * (expert * s.a + INDEX),) * 2,
            "prefetch fp8": (slots * (expert_fp8 + INDEX),) * 2,
            "reduce_grad": (0.0, slots * (expert * s.g + INDEX))}


def bytes_per_rank(s: Shape) -> dict[str, dict[str, tuple[float, float]]]:
    """mode -> operation -> (forward, backward) bytes one rank sends to the others per layer and step."""
    peers = s.R - 1
    block = traffic(s.S, s.S * s.K, s.S * s.K, s.B, s)  # the fixed blocks sent to each peer
    worst_rows, uniform_rows = s.S * min(s.K, peers), s.S * peers * (1 - (1 - 1 / s.R) ** s.K)
    remote_routes = s.S * s.K * peers / s.R
    return {"static": {op: (peers * fwd, peers * bwd) for op, (fwd, bwd) in block.items()},
            "exact, worst": traffic(worst_rows, s.S * s.K, s.S * s.K - worst_rows, s.B, s),
            "exact, uniform": traffic(uniform_rows, remote_routes, remote_routes - uniform_rows,
                                      min(s.B, 1), s)}


def mib(value: float) -> str:
    return f"{value / 2**20:,.0f}" if value >= 2**20 else f"{value / 2**20:.2f}"


def table() -> str:
    """Markdown: per config and B, MiB per rank for each operation (forward + backward) and a training step,
    as static / exact worst / exact uniform."""
    columns = (OPS[0], "dispatch fp8", *OPS[1:3], "prefetch fp8", *OPS[3:])
    head = ["config (S, K, H, H', E, R)", "B"] + [f"{op} (fwd+bwd)" for op in columns] + ["training step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in available_configs():
        try:
            cfg = load_config(name)
        except ValueError:  # not a layer config (e.g. a training YAML)
            continue
        for B in (cfg.experts_per_rank, 0):
            s = Shape.of(cfg, B)
            by_mode = bytes_per_rank(s)
            cells = [" / ".join(mib(sum(by_mode[m][op])) for m in MODES) for op in columns]
            step = {m: sum(by_mode[m][op][0] + by_mode[m][op][1] for op in OPS) for m in MODES}
            label = f"{name} ({s.S}, {s.K}, {s.H}, {s.F}, {s.E}, {s.R})"
            lines.append(f"| {label} | {B} | " + " | ".join(cells) + " | "
                         + " / ".join(mib(step[m]) for m in MODES) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("MiB one rank sends to the others per layer and step: static / exact-size worst case / exact-size "
          "uniform routing (formulas: bench/comm_bytes.py)\n")
    print(table())
