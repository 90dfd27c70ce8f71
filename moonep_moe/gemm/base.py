"""Grouped GEMMs over contiguous row segments: the three matmuls of the expert block, behind one seam.

Shapes use the suffix letters of DESIGN.md, "Notation"; ``g`` are the groups of one call (a rank's
``epn + B`` compute groups: home experts, then prefetch slots). The GEMM's own sizes are spelled out and
named after the forward product: ``x [rows, inner] @ w^T -> y [rows, cols]``, each group's weight
``w [cols, inner]`` in nn.Linear layout (cols = output features, inner = input features); the rows are
dispatched rows, grouped by expert.

Segments: ``offs_g`` int32 [G] holds cumulative END offsets; group g covers rows ``[offs[g-1], offs[g])``
(``start:end`` below) with ``offs[-1]`` taken as 0. Empty groups are allowed. Rows at and past
``offs[G-1]`` are ignored in inputs and unspecified in outputs.

Weights come as a sequence of 3D tensors ``[g_i, cols, inner]`` whose groups concatenate to G, e.g.
``(home_experts [epn, cols, inner], prefetch_slots [B, cols, inner])``, so callers never copy them together.

Primitives (every backend implements all three, as pure functions of their arguments):
- ``fwd``:   ``y[start:end] = x[start:end] @ w[g]^T``    x [rows, inner], weights -> y [rows, cols]
- ``dgrad``: ``dx[start:end] = dy[start:end] @ w[g]``    dy [rows, cols], weights -> dx [rows, inner]
- ``wgrad``: ``out[g] += dy[start:end]^T @ x[start:end]`` into ``[g_i, cols, inner]`` parts split like the
  weights, accumulated into fp32 (or wider) gradient tensors; or, overwriting, with the first part made
  fresh by the backend (the home experts' gradients in the layer's "param" mode: ``torch._grouped_mm``'s own
  output becomes them, no copy, no second full-size tensor).

Results in place: ``fwd`` and ``dgrad`` take ``out``, a ``[rows, cols]`` (``[rows, inner]``) tensor they may
write their result into and return (`into`): the layer passes the Buffer's rows, so combine reads the
expert outputs where the GEMM wrote them instead of copying them in. A backend whose kernel makes its own
output (``torch``) returns that; ``deep_gemm``, the FP8 backend and the reference write into ``out``.

Weights arriving (the prefetch slots' replicas of other ranks' experts): ``fwd`` and ``dgrad`` take
``slots_ready``, a `SlotsReady` that says from which group on the weights are slots and waits for them. A
backend that can compute the home groups alone does so first and waits between (``torch``, ``deep_gemm``:
the replicas' link time hides under the home experts' GEMM); the others wait first. Either way it waits
before it reads a slot.

Backends: ``reference`` (the oracle), ``torch`` (``torch._grouped_mm``), ``deep_gemm`` (all three; wgrad's
slot groups on Triton) and ``triton`` (wgrad, `moonep_moe.gemm.kernels.wgrad`). ``select_grouped_gemm`` is the
one place that picks; on CUDA its "auto" times the backends per primitive and weight shape once and caches
the winners (``measure_grouped_gemm``, ``ChoiceCache``: in process and in a per-user file that later
processes read), and says what it times, what it chose and where the cache file is on
``logging.getLogger("moonep_moe")`` at INFO.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "GemmProblem",
    "SlotsReady",
    "GroupedGemm",
]

logger = logging.getLogger(__name__)  # a child of "moonep_moe"

OPS = ("fwd", "dgrad", "wgrad")


@dataclass(frozen=True)
class SlotsReady:
    """Where the slots start among a call's groups, and the wait for their weights: the groups from
    `home_groups` on hold prefetched replicas that may still be arriving until `wait()` (`event`: the
    prefetch's `CommEvent`, None when they are there already)."""

    home_groups: int
    event: object | None = None
    row_alignment: int = 1
    """Every group end is a multiple of it (the layer's ``token_padding``): a backend may compute the slot
    groups with `groups_from`'s aligned kernel where it is a multiple of 128."""

    def wait(self) -> None:
        """Order the caller's stream behind the prefetch (a device-side wait: the host goes on)."""
        if self.event is not None:
            self.event.wait()


def wait_for(slots_ready: SlotsReady | None) -> None:
    """What a backend that cannot split a call does first: wait for the slots' weights."""
    if slots_ready is not None:
        slots_ready.wait()


def groups_before_wait(slots_ready: SlotsReady | None, num_groups: int, can_split: bool = True) -> int:
    """How many of a call's `num_groups` groups a backend computes before waiting for the slots' weights:
    `slots_ready.home_groups` where the call has both home groups and slots and the backend can split it
    (`can_split`); else 0, after waiting here (the whole call follows the wait)."""
    home = 0 if slots_ready is None else slots_ready.home_groups
    if can_split and 0 < home < num_groups:
        return home
    wait_for(slots_ready)
    return 0


class GroupedGemm(Protocol):
    """The grouped-GEMM seam. Output dtypes equal the input dtype; wgrad adds into the given tensors."""

    name: str
    ops: tuple[str, ...]
    """The primitives this backend computes itself; it hands the others to another backend (measured
    selection times a backend only on its own)."""
    joined_weights: bool
    """True: the layer passes home experts and slots as one tensor where the arena joins them (no copy);
    False: always as the parts, so the home experts arrive as the parameters themselves (a backend that
    caches a transform of them per parameter version, e.g. the FP8 casts, can then recognise them)."""

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        """``y [rows, cols]`` with ``y[start:end] = x[start:end] @ w[g]^T`` for every group g; the slots'
        weights read only after ``slots_ready.wait()``. ``out``: where the backend may write ``y``
        (`into`)."""
        ...

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        """``dx [rows, inner]`` with ``dx[start:end] = dy[start:end] @ w[g]`` for every group g; the slots'
        weights read only after ``slots_ready.wait()``. ``out``: where the backend may write ``dx``
        (`into`)."""
        ...

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        """Add ``dy[start:end]^T @ x[start:end]`` into group g of ``out`` (split like the weights); with
        ``accumulate=False`` overwrite instead (every group written, empty ones with zeros), which saves
        zeroing the fp32 gradients and reading them back. An empty group of the parts after the first (the
        prefetch slots) is an unused slot: overwriting may leave it as it was (nothing reads an unused slot's
        gradient; every slot a plan fills has rows).

        With ``accumulate=False`` the first part may be None: the backend makes it, a new
        ``[G - groups of the other parts, cols, inner]`` tensor in dy's dtype (fp32 accumulation inside),
        without a copy where it can. Returns the parts, the new one in place of None."""
        ...


@runtime_checkable
class Fp8RowsGemm(GroupedGemm, Protocol):
    """A grouped GEMM whose forward also takes FP8 rows: `fwd(x=(q [rows, inner] e4m3, scales [rows,
    ceil(inner/128)] fp32), ...)`. What `MoEConfig.fp8_dispatch` needs of the backend (the FP8 ones): the
    tokens are quantised before dispatch and the rows kept FP8 for backward."""

    casts_rows: bool
    """True: fwd and dgrad multiply bf16 rows cast to e4m3 per 1x128 tile (`fp8.format.quantise_rows`' bytes)
    and take such rows as ``(q, scales)`` too, dgrad as well, with the same result: so the kernel that makes
    the rows may cast them in the same pass (`layers.swiglu.swiglu_weighted_fp8`). False: bf16 rows are
    multiplied as given (a reference of FP8 weights)."""

    def quantise_rows(self, x_sh: Tensor) -> tuple[Tensor, Tensor]:
        """``x [s, inner]`` -> ``(q [s, inner] e4m3, scales [s, ceil(inner/128)] fp32)`` per 1x128 tile."""
        ...

    def dequantise_rows(self, q_mk: Tensor, scales_mk: Tensor, offs_g: Tensor, dtype: torch.dtype) -> Tensor:
        """``q * scale`` per tile in ``dtype`` for the rows up to ``offs_g[-1]`` (the rest left undefined)."""
        ...


def casts_rows(gemm: GroupedGemm) -> bool:
    """Whether `gemm` is an `Fp8RowsGemm` that casts the bf16 rows it multiplies, so takes them cast
    beforehand with the same result (`Fp8RowsGemm.casts_rows`)."""
    return isinstance(gemm, Fp8RowsGemm) and gemm.casts_rows


def into(out: Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output of a ``fwd`` or ``dgrad`` whose kernel writes into a given tensor: ``out`` where it is a
    contiguous ``[rows, cols]`` tensor of ``dtype`` on ``device``, else a new one. A caller that passes
    ``out`` (the Buffer's own rows, so combine need not copy the results in) checks whether the result *is*
    ``out``: a backend whose kernel makes its own output (``torch._grouped_mm``) returns that instead."""
    if (out is not None and out.shape == (rows, cols) and out.dtype == dtype and out.device == device
            and out.is_contiguous()):
        return out
    return torch.empty(rows, cols, dtype=dtype, device=device)


def host_segments(offs_g: Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` per group. Reads ``offs_g`` on the host (a sync on GPU)."""
    ends = offs_g.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _check_groups(parts: Sequence[Tensor], offs_g: Tensor, arg: str) -> None:
    """Shape-only check (no host sync) that ``parts`` holds one ``[cols, inner]`` matrix per segment."""
    num_groups = sum(part.shape[0] for part in parts)
    if offs_g.dim() != 1 or offs_g.dtype != torch.int32 or num_groups != offs_g.numel():
        raise ValueError(
            f"offs_g must be int32 [G] with G = total groups in {arg} ({num_groups}); "
            f"got {offs_g.dtype} {list(offs_g.shape)}"
        )


def _fresh_groups(out: Sequence[Tensor | None], offs_g: Tensor, accumulate: bool) -> int:
    """Shape-only check of a wgrad ``out`` (no host sync): the groups of its None first part (0 without)."""
    if any(part is None for part in out[1:]) or (out[0] is None and accumulate):
        raise ValueError("out: only its first part may be None (made by the backend), and only with "
                         "accumulate=False")
    given = [part for part in out if part is not None]
    if out[0] is not None:
        _check_groups(given, offs_g, "out")
        return 0
    fresh = offs_g.numel() - sum(part.shape[0] for part in given)
    if offs_g.dim() != 1 or offs_g.dtype != torch.int32 or fresh < 0:
        raise ValueError(f"offs_g must be int32 [G] with G >= the groups in out's given parts; got "
                         f"{offs_g.dtype} {list(offs_g.shape)}")
    return fresh


def _wgrad_parts(dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
                 accumulate: bool) -> list[Tensor]:
    """``out`` checked, a None first part replaced by a new uninitialised ``[fresh, cols, inner]`` tensor in
    dy's dtype: for backends that write every part themselves."""
    fresh = _fresh_groups(out, offs_g, accumulate)
    if out[0] is not None:
        return list(out)
    return [dy.new_empty(fresh, dy.shape[1], x.shape[1]), *out[1:]]


def _store_groups(grads: Tensor, out: Sequence[Tensor], accumulate: bool) -> None:
    """``grads [G, cols, inner]`` into the parts of ``out``, in order (cast to each part's dtype)."""
    for part, grad in zip(out, grads.split([part.shape[0] for part in out]), strict=True):
        _store(part, grad, accumulate)


def _store(out: Tensor, value: Tensor, accumulate: bool) -> None:
    """`out += value` or `out = value` (cast to out's dtype)."""
    if accumulate:
        out.add_(value)
    else:
        out.copy_(value)


def _cat_groups(weights: Sequence[Tensor]) -> Tensor:
    """One ``[G, cols, inner]`` tensor; copies when more than one part has groups (see ``TorchGroupedGemm``):
    with no replicas in use (B = 0) the home experts go through as they are."""
    parts = [w for w in weights if w.shape[0]] or list(weights[:1])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class GemmProblem:
    """What a layer will multiply, for measured selection.

    shapes_nk: the ``(cols, inner)`` of each projection's weights; the expert block: ``((2F, H), (H, F))``
        (the field's name predates DESIGN.md's notation and is kept for callers).
    rows_per_group: the typical rows of one home group (tokens per rank * top-k / home experts: a balanced
        plan leaves nearly every row in the home groups); timed at the next power of two, rounded up to the
        segment alignment.
    grad_dtype: the dtype wgrad writes the home experts' gradients and the slots' in (the layer's
        `expert_grad_dtype`); None: the activations' dtype promoted to at least fp32.
    groups: the ``(home, slot)`` groups of one call (the layer's ``(epn, B)``); timed on
        ``timed_groups`` of them: the home groups and the few slots a plan fills.
    fresh_home_grads: how the layer calls wgrad: True ("param" mode) with the home part None (the backend
        makes it) and the slot gradients overwritten; False ("main_grad" mode) adding into home and slot
        gradients, both of ``grad_dtype``.
    """

    shapes_nk: tuple[tuple[int, int], ...]
    rows_per_group: int
    grad_dtype: torch.dtype | None = None
    groups: tuple[int, int] = (8, 0)
    fresh_home_grads: bool = False


