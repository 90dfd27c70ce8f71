"""Sizes and layout maths of an EP group, shared by the config, the planner and the comm core: the
defaults of B (`default_slots`) and tp (`TOKEN_PADDING`), the layout check and the row capacity NvS.

Notation and suffixes: DESIGN.md, "Notation". A leaf: it imports nothing of the package.
"""

from __future__ import annotations

TOKEN_PADDING = 16
"""tp's default: every non-empty segment is padded to a multiple of it, the alignment torch._grouped_mm and
the Triton kernels take (16-byte rows of bf16 and fp32 operands)."""
BLOCK_TOKEN_PADDING = 128
"""tp where a grouped GEMM needs whole 128-row M-blocks (DeepGEMM's contiguous layout, the FP8 GEMMs)."""


def cdiv(value: int, divisor: int) -> int:
    """`ceil(value / divisor)` for host-side launch maths (`triton.cdiv` costs a Triton function call, 7 us
    a call measured with Triton 3.9, on the launch path)."""
    return -(-value // divisor)


def next_power_of_2(value: int) -> int:
    """Smallest power of two >= `value` (1 for `value` <= 1), as `triton.next_power_of_2` on the host."""
    return 1 << max(value - 1, 0).bit_length()


def align_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` (>= 1) that is >= `value`."""
    return cdiv(value, multiple) * multiple


def default_slots(num_experts: int, num_ranks: int) -> int:
    """B when none is given: `E / R` (what training needs), 0 for a single rank (nothing to replicate)."""
    return num_experts // num_ranks if num_ranks > 1 else 0


LAYOUT_NAMES = dict(E="num_experts (E={})", R="ep_size (R={})", K="top_k (K={})",
                    B="num_prefetch_slots (B={})")
"""How configs name E, R, K and B in `check_layout`'s errors (`MoEConfig`, `CommConfig`)."""


def check_layout(E: int, R: int, K: int, B: int | None, names: dict[str, str] = LAYOUT_NAMES,
                 where: str = "") -> None:
    """Raise a one-line ValueError unless E % R == 0, K <= E and 0 <= B <= E - E/R (B None: the default,
    always in range). The one check of an EP group's layout: configs, the communicator and the Buffer call
    it. `names` spells each quantity as the caller's user wrote it (a template with `{}` for the value, e.g.
    `"num_experts (E={})"` or `"E={}"`); `where` prefixes the message (e.g. `"rank 0"`)."""
    E_, R_, K_ = names["E"].format(E), names["R"].format(R), names["K"].format(K)
    problem = None
    if E % R:
        problem = f"{E_} must be divisible by {R_}"
    elif K > E:
        problem = f"{K_} must be <= {E_}"
    elif B is not None and B < 0:
        problem = f"{names['B'].format(B)} must be >= 0"
    elif B is not None and B > E - E // R:
        problem = f"{names['B'].format(B)} must be <= E - E/R = {E} - {E // R} = {E - E // R}"
    if problem is not None:
        raise ValueError(f"{where}: {problem}" if where else problem)


def rows_capacity(S: int, K: int, R: int, E: int, B: int, token_padding: int, replica_cost: int = 0) -> int:
    """NvS: rows a rank can receive. A rank has at most `epn + B` non-empty segments, each padded by fewer
    than tp rows. With `B >= epn` and exact balance (`replica_cost` 0) a rank computes at most `S*K` routes;
    with `B < epn` or a cost-aware / no replication policy it is best effort and a rank may keep all `R*S*K`
    routes of its home experts: static shapes must cover that worst case."""
    epn = E // R
    routes = S * K if B >= epn and replica_cost == 0 else R * S * K
    return align_up(routes + (token_padding - 1) * (epn + B), token_padding)
