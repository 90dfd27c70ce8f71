"""FP8 experts, the DeepSeek-V3 recipe: e4m3 values with fp32 scales, one scale per row per 128 columns for
activations (1x128 tiles) and one per 128x128 block for weights; the reference quantisers (plain torch, any
device) and `Fp8GroupedGemm`, an FP8 backend behind the grouped-GEMM seam (`moonep_moe.gemm.base`).

Shapes: ``rows x K`` activations (``_mk``), ``[G, N, K]`` weights (``_gnk``: G groups of ``[N, K]``, nn.Linear
layout); ``ceil(K/128)`` is written ``Kb``.

Scales are powers of two: the smallest ``s = 2^j`` with ``amax / s <= 448`` (amax of the tile or block,
floored at ``MIN_AMAX``), so ``amax / s`` lies in (224, 448]. Dividing by a power of two is exact, so every
implementation (torch on any device, the Triton casts compiled or interpreted) gives the same bytes, and the
quantisation error is e4m3's rounding alone: at most 2^-4 of ``|x|`` (3 mantissa bits, round to nearest) for
``|x| >= 2^-6 s``, at most ``2^-10 s`` below (e4m3's subnormal step is ``2^-9 s``). Against ``s = amax / 448``
it gives up at most one binade of range at the bottom; it is also what DeepGEMM needs on sm100 (UE8M0).

What DeepGEMM 2.8.2 takes on sm90 (read from its ``csrc/apis/layout.hpp``, ``csrc/utils/layout.hpp``,
``csrc/apis/gemm.hpp``), with ``disable_ue8m0_cast=True`` and the default recipe ``(1, 128, 128)``:
- scales are fp32 and any positive value (powers of two are required only by sm100's UE8M0 packing);
- activations' scales (SFA) ``[rows, Kb]``: MN-major with ``stride = (1, align(rows, 4))`` (16-byte TMA
  alignment) go through as they are; any other layout is transposed by a DeepGEMM kernel on every call, so
  the cast writes this layout (`tma_aligned_rows`, `to_deep_gemm_row_scales`);
- weights' scales (SFB) ``[G, ceil(N/128), Kb]``: contiguous, or contiguous after transposing the last two
  dimensions (so the transposed weight's scales are a view, ``scales.transpose(1, 2)``);
- both FP8 operands K-major: fwd (``x W^T``) takes W ``[G, N, K]`` as stored; dgrad (``dy W``) needs the
  transposed copy ``W^T [G, K, N]`` contiguous (`transpose_blocks`). A 128x128 block's scale is the same
  for W and W^T, so the copy is the transposed bytes and needs no second quantisation.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from moonep_moe.fp8.format import (
    E4M3_MAX,
    FP8_DTYPE,
    block_scales_shape,
    dequantise_blocks,
    dequantise_columns,
    dequantise_rows,
    pow2_scales,
    quantise_blocks,
    quantise_rows,
    to_deep_gemm_row_scales,
)
from moonep_moe.gemm.base import GroupedGemm, SlotsReady, _check_groups, _wgrad_parts, into, wait_for
from moonep_moe.gemm.deep_gemm import import_deep_gemm, standin_sizes
from moonep_moe.gemm.reference import ReferenceGroupedGemm
from moonep_moe.transport.arena import PhysicalRows, expert_arena_reason, with_scratch_rows
from moonep_moe.weights.quantised import Fp8Weights

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "FP8_KERNELS",
    "Fp8GroupedGemm",
    "Fp8WeightCache",
    "Fp8WeightGradient",
    "Fp8Weights",
    "ReferenceFp8Gemm",
    "dequantise_blocks",
    "dequantise_rows",
    "k_grouped_fp8_reference",
    "pow2_scales",
    "quantise_blocks",
    "quantise_rows",
    "to_deep_gemm_row_scales",
]

logger = logging.getLogger(__name__)  # a child of "moonep_moe"

FP8_KERNELS = ("deep_gemm", "triton")
"""The FP8 grouped GEMMs `Fp8GroupedGemm` runs on (`fp8_kernel` picks one)."""


# -- the FP8 backend --------------------------------------------------------------------------------------


@dataclass
class _Fp8Copy:
    """One weights sequence's kept FP8 copy in one orientation, all its parts' groups joined:
    ``q() [G, N, K]`` (transposed: ``[G, K, N]``) and ``scales [G, ceil(N/128), Kb]``; ``shapes[i]``: part
    i's shape; ``stamps[i]``: part i's `_stamp` when it was last cast (None: not kept).

    ``q`` lives in one of two ways. ``whole``: one allocation of the caching allocator, every group. Or, where
    the kept parts come first and `transport.arena` can map them (`_kept_rows`), ``kept``: their groups in an
    allocation of the layer's own, mapped before ``tail`` scratch groups for the parts cast on every call,
    the scratch shared by every copy used on the same CUDA stream (`arena.with_scratch_rows`), so a model
    pays for its slots' FP8 copies once, not once per layer and orientation. The scratch groups live from
    their cast to the GEMM right after it, in that stream's order; a copy used on another stream maps that
    stream's scratch (``views``, per stream)."""

    parts: list[weakref.ref]
    shapes: list[torch.Size]
    scales: Tensor
    stamps: list[tuple[int, int, int] | None]
    whole: Tensor | None = None
    kept: PhysicalRows | None = None
    tail: int = 0
    views: dict[int, Tensor] = field(default_factory=dict)

    def holds(self, weights: Sequence[Tensor]) -> bool:
        return len(weights) == len(self.parts) and all(
            ref() is w and w.shape == shape
            for ref, w, shape in zip(self.parts, weights, self.shapes, strict=True))

    def q(self) -> Tensor:
        if self.kept is None:
            return self.whole
        stream = torch.cuda.current_stream(self.kept.device).cuda_stream
        if stream not in self.views:
            self.views[stream] = with_scratch_rows(self.kept, self.tail, (SCRATCH_KEY, stream))
        return self.views[stream]


SCRATCH_KEY = "fp8 weight copies: groups cast on every call"


def _kept_rows(weights: Sequence[Tensor], kept: Sequence[bool], transposed: bool) -> PhysicalRows | None:
    """The kept parts' FP8 groups as `transport.arena` memory of their own, to be mapped before scratch groups
    for the rest (`_Fp8Copy`), where that works: CUDA weights whose kept parts all come before the others,
    with at least one of each, and the kept groups' bytes a multiple of the mapping granularity
    (`expert_arena_reason`). Else None (one allocation for every group)."""
    first = kept.index(False) if False in kept else len(kept)
    if not weights[0].is_cuda or first == 0 or first == len(kept) or any(kept[first:]):
        return None
    groups = sum(w.shape[0] for w in weights[:first])
    _, *row_shape = _joined_shape(weights, transposed)
    if expert_arena_reason(weights[0].device, [groups * math.prod(row_shape) * FP8_DTYPE.itemsize]):
        return None
    return PhysicalRows(groups, tuple(row_shape), FP8_DTYPE, weights[0].device)


def _joined_shape(weights: Sequence[Tensor], transposed: bool) -> tuple[int, int, int]:
    g, (n, k) = sum(w.shape[0] for w in weights), weights[0].shape[1:]
    return (g, k, n) if transposed else (g, n, k)


def _empty_q(weights: Sequence[Tensor], transposed: bool) -> Tensor:
    """Uninitialised FP8 ``q`` for all ``weights``' groups joined, in the orientation asked for."""
    return weights[0].new_empty(_joined_shape(weights, transposed), dtype=FP8_DTYPE)


def _empty_scales(weights: Sequence[Tensor]) -> Tensor:
    """Uninitialised fp32 ``scales [G, ceil(N/128), Kb]`` for all ``weights``' groups joined."""
    return weights[0].new_empty(block_scales_shape(_joined_shape(weights, False)), dtype=torch.float32)


def _oriented(q: Tensor, scales: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """``(q, scales)`` as DeepGEMM takes them: a transposed ``q`` with its scales as a transposed view."""
    return (q, scales.transpose(1, 2)) if transposed else (q, scales)


class OptimizerSteps:
    """How many `torch.optim` optimizer steps this process has taken (any optimizer: torch's global step
    post-hook, registered by the first `Fp8WeightCache`). A kept FP8 copy is stale after one: fused optimizers
    (``AdamW(fused=True)``) write the parameters without moving their ``._version``, and Megatron-style
    wrappers copy the new values in through ``.data`` after their inner step."""

    count = 0
    _hook = None

    @classmethod
    def watch(cls) -> None:
        if cls._hook is None:
            cls._hook = register_optimizer_step_post_hook(cls._stepped)

    @classmethod
    def _stepped(cls, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        cls.count += 1


def _stamp(part: Tensor) -> tuple[int, int, int]:
    """What changes when a parameter's values may have: its version, its storage, the optimizer steps."""
    return part._version, part.data_ptr(), OptimizerSteps.count


class Fp8WeightCache:
    """FP8 copies of grouped bf16 weights, cast by `kernels.fp8_cast.cast_blocks` straight into one joined
    buffer per weights sequence and orientation (no ``torch.cat``).

    The copy of every ``nn.Parameter`` part (the home experts: the layer passes them as the parameters
    themselves) is kept, in each orientation asked for (the forward's ``q``; the transposed ``qt`` that dgrad
    takes, asked for in backward only; once both are kept, a stale part is cast into both in one pass over its
    bf16 weights, so training reads them once per optimizer step), and cast again only when the parameter may
    have changed: its ``._version`` moved (any in-place torch op, ``load_state_dict``), its storage changed,
    or any `torch.optim` optimizer stepped since (`OptimizerSteps`: fused optimizers move no version). So
    gradient accumulation casts the home weights once per optimizer step, not once per micro-batch, and
    inference once per weight version, with nothing for the caller to do. A write that bypasses all three
    (``param.data.copy_`` outside an optimizer step) is not seen. Other parts, the prefetch slots (rewritten
    by kernels with every plan) and the arena's joined view, are cast on every call into the same joined copy,
    only their groups that the call's GEMM gives rows (``offs_g``, read on the device: a plan fills few of its
    slots). While a CUDA graph is being captured every part is cast in the call (the replay then casts again:
    the cache is a host-side decision a replay cannot make).

    Memory: a training layer keeps both orientations of its home experts, as many bytes as their bf16
    weights; inference keeps the forward copy only. The slots' groups, cast on every call, are a scratch
    that every copy used on the same CUDA stream shares where the arena can map it (`_Fp8Copy`), else part
    of each copy. `release` drops them (the end of a `moonep_moe.fixed_expert_weights` block does).
    """

    def __init__(self) -> None:
        from moonep_moe.fp8 import cast as fp8_cast

        OptimizerSteps.watch()
        self._kernels = fp8_cast
        self._copies: dict[bool, WeakIdKeyDictionary] = {False: WeakIdKeyDictionary(),
                                                         True: WeakIdKeyDictionary()}
        self.fixed = 0
        """Nesting depth of `moonep_moe.fixed_expert_weights` blocks: the outermost one's end releases."""

    def get(self, weights: Sequence[Tensor], transposed: bool,
            offs_g: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(q [G, N, K], scales [G, ceil(N/128), Kb])`` of ``weights`` (parts ``[g_i, N, K]`` whose groups
        concatenate to G), or with ``transposed`` ``(qt [G, K, N], scales^T [G, Kb, ceil(N/128)])``. With
        ``offs_g`` (the GEMM's int32 ``[G]`` segment ends) the groups of parts not kept whose segment is
        empty are left as they are (unspecified: no GEMM on ``offs_g`` reads them)."""
        capturing = weights[0].is_cuda and torch.cuda.is_current_stream_capturing()
        kept = [not capturing and isinstance(w, nn.Parameter) for w in weights]
        if not any(kept):
            return self._cast(weights, transposed, offs_g)
        copies = self._copies[transposed]
        copy = copies.get(weights[0])
        if copy is None or not copy.holds(weights):
            copy = copies[weights[0]] = self._new_copy(weights, kept, transposed)
        partner = self._copies[not transposed].get(weights[0])  # the other orientation's copy, if kept
        if partner is not None and not partner.holds(weights):
            partner = None
        q = copy.q()
        start = 0
        for i, (part, keep) in enumerate(zip(weights, kept, strict=True)):
            stop = start + part.shape[0]
            stamp = _stamp(part) if keep else None
            if stamp is None or stamp != copy.stamps[i]:
                # a kept part whose other orientation is kept and stale too: both in one pass over the bf16
                # weights (the block scales are the same for both)
                both = stamp is not None and partner is not None and partner.stamps[i] != stamp
                self._cast_part(part, copy.scales[start:stop], q[start:stop], transposed,
                                None if keep else offs_g, start, partner.q()[start:stop] if both else None)
                copy.stamps[i] = stamp
                if both:
                    partner.scales[start:stop].copy_(copy.scales[start:stop])
                    partner.stamps[i] = stamp
            start = stop
        return _oriented(q, copy.scales, transposed)

    @staticmethod
    def _new_copy(weights: Sequence[Tensor], kept: Sequence[bool], transposed: bool) -> _Fp8Copy:
        """An uncast `_Fp8Copy` of ``weights``: the kept groups in memory of their own before shared scratch
        groups where the arena can map them (`_kept_rows`), else every group in one allocation."""
        parts, shapes = [weakref.ref(w) for w in weights], [w.shape for w in weights]
        scales, home = _empty_scales(weights), _kept_rows(weights, kept, transposed)
        stamps = [None] * len(weights)
        if home is None:
            return _Fp8Copy(parts, shapes, scales, stamps, whole=_empty_q(weights, transposed))
        groups = _joined_shape(weights, transposed)[0]
        return _Fp8Copy(parts, shapes, scales, stamps, kept=home, tail=groups - home.rows)

    def release(self) -> None:
        """Drop every kept copy (the next call casts again)."""
        for copies in self._copies.values():
            copies.clear()

    def _cast(self, weights: Sequence[Tensor], transposed: bool,
              offs_g: Tensor | None) -> tuple[Tensor, Tensor]:
        """Every part cast into fresh joined buffers, one orientation (with ``offs_g``: its groups with
        rows)."""
        out, scales = _empty_q(weights, transposed), _empty_scales(weights)
        start = 0
        for part in weights:
            stop = start + part.shape[0]
            self._cast_part(part, scales[start:stop], out[start:stop], transposed, offs_g, start)
            start = stop
        return _oriented(out, scales, transposed)

    def _cast_part(self, part: Tensor, scales: Tensor, out: Tensor, transposed: bool,
                   offs_g: Tensor | None, first_group: int, other: Tensor | None = None) -> None:
        """``part`` cast into ``out`` (the orientation asked for) and, where given, ``other`` (the other)."""
        q_out, qt_out = (other, out) if transposed else (out, other)
        self._kernels.cast_blocks(part, scales, q_out, qt_out, offs_g=offs_g, first_group=first_group)


class Fp8GroupedGemm:
    """FP8 fwd and dgrad on the segments' padded ends ``offs_g`` (read on the device, no host sync), taking
    bf16 activations and bf16 master weights as the other backends do and casting inside: the activations on
    every call (`kernels.fp8_cast.cast_rows`, one pass, rows past ``offs_g[-1]`` skipped), the weights through
    `Fp8WeightCache` (the home parameters' copies kept until they may have changed). Outputs are
    bf16. dgrad multiplies by the K-major transposed FP8 copy of each weight (sm90 takes FP8 operand B only
    K-major).

    ``kernel`` (`FP8_KERNELS`, chosen by `fp8_kernel`): "deep_gemm", DeepGEMM's
    ``m_grouped_fp8_gemm_nt_contiguous`` on the psum layout (sm90 only: fp32 scales); or "triton", the
    package's Triton FP8 grouped GEMM (`kernels.fp8_gemm`: the same operands and scales, any GPU with FP8
    tensor cores), where DeepGEMM is not installed or the GPU is not sm90.

    The weight gradient runs in bf16 on ``wgrad`` (the backend ``grouped_gemm`` selects), or with
    ``fp8_wgrad`` as FP8 GEMMs too (`Fp8WeightGradient`: DeepGEMM's sm90 k-grouped FP8 kernel, ``kernel=
    "deep_gemm"`` only). In bf16, wgrad is a third of the expert block's GEMM FLOPs at the bf16 rate, so at
    1.6x on fwd and dgrad the GEMM time is at best ``(2 / 1.6 + 1) / 3 = 0.75`` of bf16's (1.33x).

    Experts kept FP8 (`MoEConfig.expert_weights="fp8"`) come to ``fwd`` as `Fp8Weights`: multiplied as they
    are (joined into one tensor only where they come in parts), no cast, no bf16 copy; such a layer has no
    weight gradients (``wgrad=None``).

    Needs CUDA with FP8 tensor cores, bf16 and segments starting at multiples of 128
    (`fp8_unsupported_reason`).
    """

    joined_weights = False  # the home parameters themselves, so their FP8 copies are kept per version
    casts_rows = True  # `Fp8RowsGemm.casts_rows`: rows given as (q, scales) skip the cast

    def __init__(self, wgrad: GroupedGemm | None, kernel: str = "deep_gemm", fp8_wgrad: bool = False) -> None:
        from moonep_moe.fp8.cast import cast_rows, dequantise_rows

        if fp8_wgrad and (kernel != "deep_gemm" or wgrad is None):
            raise ValueError(f"fp8_wgrad runs on DeepGEMM's sm90 k-grouped FP8 GEMM: it needs kernel="
                             f"'deep_gemm' and trainable weights, got kernel={kernel!r}"
                             + " and no weight gradients" * (wgrad is None))

        if kernel == "deep_gemm":
            self._kernel = functools.partial(import_deep_gemm().m_grouped_fp8_gemm_nt_contiguous,
                                             disable_ue8m0_cast=True, use_psum_layout=True)
        elif kernel == "triton":
            from moonep_moe.gemm.kernels.fp8_gemm import grouped_fp8_gemm

            self._kernel = grouped_fp8_gemm
        else:
            raise ValueError(f"kernel must be one of {FP8_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.name = "fp8_wgrad" if fp8_wgrad else "fp8" if kernel == "deep_gemm" else f"fp8_{kernel}"
        self._cast_rows, self._dequantise_rows = cast_rows, dequantise_rows
        self._wgrad = Fp8WeightGradient() if fp8_wgrad else wgrad
        self.ops = ("fwd", "dgrad", "wgrad") if fp8_wgrad else ("fwd", "dgrad")
        self.weights = Fp8WeightCache()

    def quantise_rows(self, x_sh: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens ``x [s, H]`` -> ``(q [s, H] e4m3, scales [s, ceil(H/128)] fp32)``, every row cast on the
        device: what a layer dispatches as FP8 (`MoEConfig.fp8_dispatch`) and then gives ``fwd`` as it
        arrives."""
        ends = torch.full((1,), x_sh.shape[0], dtype=torch.int32, device=x_sh.device)
        return self._cast_rows(x_sh, ends)

    def dequantise_rows(self, q_mk: Tensor, scales_mk: Tensor, offs_g: Tensor, dtype: torch.dtype) -> Tensor:
        """FP8 rows ``(q [rows, K], scales)`` as `fwd` took them -> ``q * scale`` in ``dtype``, exactly, in
        one pass on the device (rows past ``offs_g[-1]`` unspecified): the rows gate_up's weight gradient
        multiplies under `MoEConfig.fp8_dispatch`."""
        return self._dequantise_rows(q_mk, scales_mk, offs_g, dtype)

    def fwd(self, x: Tensor | tuple[Tensor, Tensor], weights: Sequence[Tensor] | Fp8Weights,
            offs_g: Tensor, slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        """``x``: bf16 rows (cast here), or rows already FP8 as ``(q, scales)`` (`quantise_rows`' layout,
        e.g. as a dispatch returns them)."""
        wait_for(slots_ready)
        if isinstance(weights, Fp8Weights):
            _check_groups(weights.q, offs_g, "weights")
            return self._gemm(x, *weights.joined(), offs_g, out)
        _check_groups(weights, offs_g, "weights")
        return self._gemm(x, *self.weights.get(weights, transposed=False, offs_g=offs_g), offs_g, out)

    def dgrad(self, dy: Tensor | tuple[Tensor, Tensor], weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        """``dy``: bf16 rows (cast here) or already FP8 ``(q, scales)``, as in `fwd`."""
        wait_for(slots_ready)
        _check_groups(weights, offs_g, "weights")
        return self._gemm(dy, *self.weights.get(weights, transposed=True, offs_g=offs_g), offs_g, out)

    def _gemm(self, a: Tensor | tuple[Tensor, Tensor], q_w: Tensor, scales_w: Tensor,
              offs_g: Tensor, out: Tensor | None) -> Tensor:
        """``a [rows, k] @ w^T`` per segment into bf16 (``out`` where it fits, `into`), ``a`` bf16 or already
        FP8 ``(q, scales)``, ``w`` the FP8 ``q_w [G, n, k]`` with its block scales."""
        if isinstance(a, tuple):
            q_a, scales_a = a
            if self.kernel == "deep_gemm":  # its sm90 SFA layout (else it transposes them on every call)
                scales_a = to_deep_gemm_row_scales(scales_a)
        else:
            q_a, scales_a = self._cast_rows(a, offs_g)
        d = into(out, q_a.shape[0], q_w.shape[1], torch.bfloat16, q_a.device)
        self._kernel((q_a, scales_a), (q_w, scales_w), d, offs_g)
        return d

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        if self._wgrad is None:
            raise ValueError(FORWARD_ONLY)
        return self._wgrad.wgrad(dy, x, offs_g, out, accumulate)


class Fp8WeightGradient:
    """``dW[g] (+)= dy_g^T x_g`` as FP8 GEMMs: `GroupedGemm.wgrad`, what `Fp8GroupedGemm` runs with
    ``fp8_wgrad``.

    Each part of ``out`` (the home experts' gradients, then the slots') is one call over its range of
    segments: both operands cast on the device (`fp8.cast.cast_columns`: each segment transposed to
    K-major, one power-of-two scale per column per 128 rows, packed from the part's first row), then
    DeepGEMM's sm90 ``k_grouped_fp8_gemm_nt_contiguous`` adds the products into an fp32 tensor, promoting
    each 128-row step's tensor-core sum to fp32. It reads the segment sizes on the device; its host list is a
    fixed stand-in (`deep_gemm.standin_sizes`), so there is no host read. fp32 parts (``main_grad``, the
    slot gradients) are added into, or to overwrite, their groups with rows are zeroed first
    (`zero_filled_groups`: unused slots stay as they are). Every part must be contiguous fp32 (ValueError
    otherwise): the kernel adds its fp32 products into ``d`` with a TMA reduce, so a bf16 gradient would need
    an fp32 temporary each way, which cost more than FP8 saved (`MoEConfig.fp8_wgrad` needs ``main_grad``).

    ``kernel``: the GEMM, called as DeepGEMM's (``kernel((q_a, scales_a), (q_b, scales_b), d, sizes_host,
    sizes_g, c)``); the default imports DeepGEMM. Segments must be multiples of 128 rows (``token_padding``
    128).
    """

    def __init__(self, kernel=None) -> None:
        from moonep_moe.fp8.cast import cast_columns
        from moonep_moe.gemm.kernels.wgrad import zero_filled_groups

        self._kernel = kernel or import_deep_gemm().k_grouped_fp8_gemm_nt_contiguous
        self._cast, self._zero = cast_columns, zero_filled_groups

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        parts = _wgrad_parts(dy, x, offs_g, out, accumulate)
        for i, part in enumerate(parts):
            if part.dtype != torch.float32 or not part.is_contiguous():
                raise ValueError(f"Fp8WeightGradient adds into contiguous fp32 gradients (main_grad, the "
                                 f"slots'), got out[{i}] of dtype {part.dtype}"
                                 + ("" if part.is_contiguous() else ", not contiguous"))
        first = 0
        for i, part in enumerate(parts):
            last = first + part.shape[0]
            if part.shape[0]:
                self._part(dy, x, offs_g, first, last, part, accumulate, slots=i > 0)
            first = last
        return parts

    def _part(self, dy: Tensor, x: Tensor, offs_g: Tensor, first: int, last: int, out_gmn: Tensor,
              accumulate: bool, slots: bool) -> None:
        """Groups ``[first, last)`` of ``offs_g`` into the fp32 ``out [last - first, cols, inner]``;
        ``slots``: the prefetch slots', whose empty groups (unused slots) an overwrite leaves as they are."""
        if not accumulate and slots:
            self._zero(out_gmn, offs_g, first)
        elif not accumulate:
            out_gmn.zero_()
        self._call(dy, x, offs_g, first, last, out_gmn)

    def _call(self, dy: Tensor, x: Tensor, offs_g: Tensor, first: int, last: int, d_gmn: Tensor) -> None:
        """``d [last - first, cols, inner]`` (contiguous fp32) += the FP8 products of segments
        ``[first, last)``: both operands cast, one kernel call."""
        q_a, scales_a = self._cast(dy, offs_g, first, last)
        q_b, scales_b = self._cast(x, offs_g, first, last)
        start = offs_g[first - 1:first] if first else offs_g.new_zeros(1)
        sizes_g = torch.diff(offs_g[first:last], prepend=start)
        self._kernel((q_a, scales_a), (q_b, scales_b), d_gmn,
                     standin_sizes(last - first, q_a.numel() // dy.shape[1]), sizes_g, d_gmn)


def k_grouped_fp8_reference(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], d_gmn: Tensor,
                            sizes_host: Sequence[int], sizes_g: Tensor, c_gmn: Tensor) -> None:
    """DeepGEMM's ``k_grouped_fp8_gemm_nt_contiguous`` in torch, for tests and CPUs: ``d[g] = c[g] + A_g^T
    B_g`` in fp32, ``A_g``, ``B_g`` the operands `cast_columns` wrote (``(q, scales)`` each), dequantised
    exactly (`dequantise_columns`). Reads the segment sizes ``sizes_g`` on the host (a sync); like
    DeepGEMM's it checks ``sizes_host`` only for its count and sum."""
    (q_a, scales_a), (q_b, scales_b) = a, b
    sizes = sizes_g.tolist()
    if len(sizes_host) != len(sizes) or sum(sizes_host) * scales_a.shape[0] != q_a.numel():
        raise ValueError(f"sizes_host must have one entry per group ({len(sizes)}) and sum to the operands' "
                         f"rows ({q_a.numel() // scales_a.shape[0]}), got {list(sizes_host)}")
    pairs = zip(dequantise_columns(q_a, scales_a, sizes, torch.float32),
                dequantise_columns(q_b, scales_b, sizes, torch.float32), strict=True)
    for g, (a_km, b_kn) in enumerate(pairs):
        d_gmn[g] = c_gmn[g] + a_km.t() @ b_kn


FORWARD_ONLY = "experts kept FP8 (expert_weights='fp8') run forward only: no master weights to train"


class ReferenceFp8Gemm:
    """Experts kept FP8 (`Fp8Weights`) on any device, for tests and CPUs: each weight dequantised exactly
    (``q * scale`` per 128x128 block in fp32: with power-of-two scales the products are exact) and multiplied
    by the activations as given, per segment, in fp32 (`ReferenceGroupedGemm`: it reads ``offs_g`` on the
    host, and holds a transient fp32 copy of the weights). The activations are not cast to FP8: this is
    each expert's checkpoint value applied to the layer's activations, equal to the bf16 masters' GEMM on
    the dequantised weights; the FP8 GEMMs' path (`Fp8GroupedGemm`) also rounds the activations to e4m3 per
    1x128 tile. Forward only (`FORWARD_ONLY`)."""

    name = "reference_fp8"
    ops = ("fwd",)
    joined_weights = True
    casts_rows = False

    def quantise_rows(self, x_sh: Tensor) -> tuple[Tensor, Tensor]:
        """As `Fp8GroupedGemm.quantise_rows`, with the reference cast (any device)."""
        return quantise_rows(x_sh)

    def dequantise_rows(self, q_mk: Tensor, scales_mk: Tensor, offs_g: Tensor, dtype: torch.dtype) -> Tensor:
        """As `Fp8GroupedGemm.dequantise_rows`, with the reference (every row, any device)."""
        return dequantise_rows(q_mk, scales_mk, dtype)

    def fwd(self, x: Tensor | tuple[Tensor, Tensor], weights: Fp8Weights, offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        """``x``: rows as given, or FP8 ``(q, scales)`` rows, dequantised exactly into bf16 (the layer's
        dtype with FP8 experts) first."""
        wait_for(slots_ready)
        if isinstance(x, tuple):
            x = dequantise_rows(*x, torch.bfloat16)
        dequantised = [dequantise_blocks(q, scales, torch.float32)
                       for q, scales in zip(weights.q, weights.scales, strict=True)]
        return ReferenceGroupedGemm().fwd(x, dequantised, offs_g, out=out)

    def dgrad(self, dy: Tensor, weights: Fp8Weights, offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        raise ValueError(FORWARD_ONLY)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        raise ValueError(FORWARD_ONLY)


