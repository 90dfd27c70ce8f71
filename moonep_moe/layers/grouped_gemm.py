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

Backends: ``reference`` (the oracle), ``torch`` (``torch._grouped_mm``), ``deep_gemm`` (fwd and dgrad) and
``triton`` (wgrad, `moonep_moe.layers.kernels.wgrad`). ``select_grouped_gemm`` is the one place that picks;
on CUDA its "auto" times the backends per primitive and weight shape once and caches the winners
(``measure_grouped_gemm``, ``ChoiceCache``: in process and in a per-user file that later processes read), and
says what it times, what it chose and where the cache file is on ``logging.getLogger("moonep_moe")`` at INFO.
"""

import dataclasses
import itertools
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "ChoiceCache",
    "GemmProblem",
    "GroupedGemm",
    "MeasuredGroupedGemm",
    "ReferenceGroupedGemm",
    "TorchGroupedGemm",
    "TritonGroupedGemm",
    "measure_grouped_gemm",
    "select_grouped_gemm",
]

logger = logging.getLogger(__name__)  # a child of "moonep_moe"

GROUPED_GEMM_NAMES = ("auto", "torch", "reference", "deep_gemm", "triton")
OPS = ("fwd", "dgrad", "wgrad")


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

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor, frozen: bool = False) -> Tensor:
        """``y [rows, cols]`` with ``y[start:end] = x[start:end] @ w[g]^T`` for every group g. ``frozen``: the
        weights get no gradient from this call (inference, or experts that do not train), so they stay as
        they are until changed in place; a backend may keep what it derives from them (the FP8 copies)
        across calls."""
        ...

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor) -> Tensor:
        """``dx [rows, inner]`` with ``dx[start:end] = dy[start:end] @ w[g]`` for every group g."""
        ...

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        """Add ``dy[start:end]^T @ x[start:end]`` into group g of ``out`` (split like the weights); with
        ``accumulate=False`` overwrite instead (every group written, empty ones with zeros), which saves
        zeroing the fp32 gradients and reading them back.

        With ``accumulate=False`` the first part may be None: the backend makes it, a new
        ``[G - groups of the other parts, cols, inner]`` tensor in dy's dtype (fp32 accumulation inside),
        without a copy where it can. Returns the parts, the new one in place of None."""
        ...


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


def _host_segments(offs_g: Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` per group. Reads ``offs_g`` on the host (a sync on GPU)."""
    ends = offs_g.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _segment_matmul(a: Tensor, weights: Sequence[Tensor], offs_g: Tensor, transpose_w: bool) -> Tensor:
    """``a[start:end] @ w[g]^T`` (``transpose_w``) or ``a[start:end] @ w[g]`` per group, in fp32 or wider."""
    _check_groups(weights, offs_g, "weights")
    compute = torch.promote_types(a.dtype, torch.float32)
    ws = [w.T if transpose_w else w for part in weights for w in part.unbind(0)]
    out = a.new_zeros(a.shape[0], ws[0].shape[1])
    for (start, end), w in zip(_host_segments(offs_g), ws, strict=True):
        out[start:end] = (a[start:end].to(compute) @ w.to(compute)).to(a.dtype)
    return out


class ReferenceGroupedGemm:
    """A plain loop over groups: any device, any floating dtype (float64 included).

    Computes in ``torch.promote_types(dtype, float32)`` and casts results to the input dtype; output rows
    past the last segment are zero. It reads ``offs_g`` on the host: on a GPU this is a device-to-host sync,
    so use it for tests and as the oracle, not in a step that must stay sync-free.
    """

    name = "reference"
    ops = OPS
    joined_weights = True

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor, frozen: bool = False) -> Tensor:
        return _segment_matmul(x, weights, offs_g, transpose_w=True)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor) -> Tensor:
        return _segment_matmul(dy, weights, offs_g, transpose_w=False)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        parts = _wgrad_parts(dy, x, offs_g, out, accumulate)
        compute = torch.promote_types(x.dtype, torch.float32)
        group_outs = [group_out for part in parts for group_out in part.unbind(0)]
        for (start, end), group_out in zip(_host_segments(offs_g), group_outs, strict=True):
            _store(group_out, dy[start:end].to(compute).T @ x[start:end].to(compute), accumulate)
        return parts


class TorchGroupedGemm:
    """``torch._grouped_mm``: no host sync, reads ``offs_g`` on the device.

    fwd and dgrad are 2D x 3D calls with ``offs``; wgrad is a 2D x 2D call giving ``[G, cols, inner]``, which
    is added into the fp32 gradients. ``torch._grouped_mm`` insists that its output dtype equals its input
    dtype, so for bf16 each wgrad product is rounded to bf16 before that fp32 add.

    A wgrad whose first part is to be made (None: the home experts' gradients, "param" mode) gets
    ``torch._grouped_mm(dy^T, x, offs=offs_g[:n])`` itself: rows past the n-th group's end are ignored, so
    that call computes exactly the first n groups, and its output is the gradient (no copy). The later
    groups (prefetch slots, B > 0) start at a row known only on the device, which ``torch._grouped_mm``
    cannot skip to: on CUDA they go to the Triton wgrad (`moonep_moe.layers.kernels.wgrad`, which starts at
    any group, written straight into the fp32 slot gradients); elsewhere a call over all G groups gives
    them, which computes the first n groups a second time and holds a ``[G, cols, inner]`` temporary.

    Known cost: a weights sequence of more than one tensor (home experts + slots) is joined with
    ``torch.cat`` on every call, a copy of the weights; a later issue removes it.

    Limits (torch 2.13, found by experiment; ``select_grouped_gemm`` checks them): float32, bfloat16 and
    float16 on CPU, bfloat16 on CUDA; every operand's row stride (inner and cols) must be a multiple of 16
    bytes.
    """

    name = "torch"
    ops = OPS
    joined_weights = True

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor, frozen: bool = False) -> Tensor:
        _check_groups(weights, offs_g, "weights")
        return torch._grouped_mm(x, _cat_groups(weights).transpose(-2, -1), offs=offs_g)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor) -> Tensor:
        _check_groups(weights, offs_g, "weights")
        return torch._grouped_mm(dy, _cat_groups(weights), offs=offs_g)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        fresh = _fresh_groups(out, offs_g, accumulate)
        if out[0] is not None:
            _store_groups(torch._grouped_mm(dy.T, x, offs=offs_g), out, accumulate)
            return list(out)
        made = torch._grouped_mm(dy.T, x, offs=offs_g[:fresh])  # [fresh, cols, inner], the rest ignored
        later = out[1:]
        if any(part.shape[0] for part in later):
            if dy.is_cuda:
                from moonep_moe.layers.kernels.wgrad import grouped_wgrad_triton

                grouped_wgrad_triton(dy, x, offs_g, later, accumulate=False, first_group=fresh)
            else:
                _store_groups(torch._grouped_mm(dy.T, x, offs=offs_g)[fresh:], later, accumulate=False)
        return [made, *later]


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


_TORCH_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}


def _torch_unsupported_reason(device: torch.device, dtype: torch.dtype, k: int | None) -> str | None:
    """Why ``torch._grouped_mm`` cannot run this case, or None when it can."""
    dtypes = _TORCH_DTYPES.get(device.type, ())
    if dtype not in dtypes:
        return f"torch._grouped_mm on {device.type} supports {[str(d) for d in dtypes]}, got {dtype}"
    if k is not None and k * dtype.itemsize % 16:
        return f"row strides must be multiples of 16 bytes; k={k} of {dtype} is {k * dtype.itemsize} bytes"
    return None


def import_deep_gemm():
    """`import deep_gemm`, after loading libstdc++ with RTLD_GLOBAL.

    Without that, DeepGEMM's JIT segfaults in `std::regex` on its first call on the H200 image (torch 2.11,
    the system libstdc++ 6.0.33 already mapped: a symbol-resolution clash, not a missing library). Loading
    the same libstdc++ again with RTLD_GLOBAL, after torch, fixes it in-process: measured by
    `python -m bench.deep_gemm_probe`, so users need no LD_PRELOAD.
    """
    import ctypes
    import ctypes.util

    ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    import deep_gemm

    return deep_gemm


class DeepGemmGroupedGemm:
    """DeepGEMM on Hopper: fwd and dgrad through ``m_grouped_bf16_gemm_{nt,nn}_contiguous`` with
    ``use_psum_layout=True``, which takes the padded segment end offsets (``offs_g``) directly on the device:
    no host sync. Every segment must start at a multiple of 128 (``token_padding`` a multiple of 128).

    The weight gradient runs on ``torch._grouped_mm``: DeepGEMM's k-grouped wgrad needs the segment sizes as a
    host list (a device-to-host read per call), which the no-host-sync rule forbids. A weights sequence of
    several non-empty parts is joined with ``torch.cat`` as in ``TorchGroupedGemm`` (pass one arena tensor to
    avoid the copy: ``ExpertRows.compute_weights``).
    """

    name = "deep_gemm"
    ops = ("fwd", "dgrad")
    joined_weights = True

    def __init__(self) -> None:
        self._deep_gemm = import_deep_gemm()
        self._torch = TorchGroupedGemm()

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor, frozen: bool = False) -> Tensor:
        return self._psum(self._deep_gemm.m_grouped_bf16_gemm_nt_contiguous, x, weights, offs_g, dim=1)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor) -> Tensor:
        # DeepGEMM's operand b, [G, K, N] in its own letters, is w as stored: [G, cols, inner]
        nn = self._deep_gemm.m_grouped_bf16_gemm_nn_contiguous
        return self._psum(nn, dy, weights, offs_g, dim=2)

    @staticmethod
    def _psum(kernel, a: Tensor, weights: Sequence[Tensor], offs_g: Tensor, dim: int) -> Tensor:
        """`kernel(a, w, out, offs)` on the psum layout; `out` has `w.shape[dim]` columns."""
        _check_groups(weights, offs_g, "weights")
        joined = _cat_groups(weights)
        out = a.new_empty(a.shape[0], joined.shape[dim])
        kernel(a, joined, out, offs_g, use_psum_layout=True)
        return out

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        return self._torch.wgrad(dy, x, offs_g, out, accumulate)


def deep_gemm_unsupported_reason(device: torch.device, dtype: torch.dtype,
                                 token_padding: int | None) -> str | None:
    """Why DeepGEMM's bf16 grouped GEMMs cannot run here (device, dtype, alignment, import), or None."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return f"DeepGEMM runs bf16 on CUDA, got {dtype} on {device.type}"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "DeepGEMM needs sm90 (Hopper) or newer"
    if token_padding is None or token_padding % 128:
        return f"DeepGEMM needs segments aligned to 128 rows (token_padding % 128 == 0), got {token_padding}"
    try:
        import_deep_gemm()
    except ImportError as error:
        return f"deep_gemm cannot be imported ({error}); install the 'gpu' extra (README, GPU section)"
    return None


class TritonGroupedGemm:
    """wgrad on the Triton kernel (`moonep_moe.layers.kernels.wgrad`): ``dy^T x`` accumulated in fp32 and
    written once into the gradients (fp32, or the parameters' dtype), overwrite or add, without the bf16
    product pass of ``torch._grouped_mm``; no host sync. fwd and dgrad are ``TorchGroupedGemm``'s.

    bf16 or fp16 inputs, on CUDA (on CPU only under Triton's interpreter, for tests). The first wgrad per
    weight shape autotunes the kernel's tiles (host syncs then; measured selection does it at construction).
    """

    name = "triton"
    ops = ("wgrad",)
    joined_weights = True

    def __init__(self) -> None:
        from moonep_moe.layers.kernels.wgrad import grouped_wgrad_triton

        self._wgrad = grouped_wgrad_triton
        self._torch = TorchGroupedGemm()

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor, frozen: bool = False) -> Tensor:
        return self._torch.fwd(x, weights, offs_g, frozen)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor) -> Tensor:
        return self._torch.dgrad(dy, weights, offs_g)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        parts = _wgrad_parts(dy, x, offs_g, out, accumulate)
        self._wgrad(dy, x, offs_g, parts, accumulate)
        return parts


def _triton_unsupported_reason(device: torch.device, dtype: torch.dtype, k: int | None) -> str | None:
    if device.type != "cuda":
        return f"the Triton wgrad runs on CUDA, got {device.type}"
    reason = _torch_unsupported_reason(device, dtype, k)  # fwd and dgrad
    if reason is not None:
        return reason
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton cannot be imported ({error})"
    return None


class MeasuredGroupedGemm:
    """Sends each call to the backend measured fastest for its primitive and weight shape ``[cols, inner]``
    (built by ``measure_grouped_gemm``); shapes that were not measured go to ``fallback``. Pure dispatch: a
    dict look-up per call, no host sync."""

    name = "auto"
    ops = OPS
    joined_weights = True

    def __init__(self, chosen: dict[tuple[str, int, int], GroupedGemm], fallback: GroupedGemm) -> None:
        self.chosen = chosen
        """``(op, cols, inner) -> backend``."""
        self.fallback = fallback

    def _for(self, op: str, cols: int, inner: int) -> GroupedGemm:
        return self.chosen.get((op, cols, inner), self.fallback)

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor, frozen: bool = False) -> Tensor:
        return self._for("fwd", *weights[0].shape[-2:]).fwd(x, weights, offs_g, frozen)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor) -> Tensor:
        return self._for("dgrad", *weights[0].shape[-2:]).dgrad(dy, weights, offs_g)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        return self._for("wgrad", dy.shape[-1], x.shape[-1]).wgrad(dy, x, offs_g, out, accumulate)

    def describe(self) -> str:
        """``"fwd 4096x7168: deep_gemm, ..."``: each primitive and weight shape with its backend."""
        return ", ".join(f"{op} {cols}x{inner}: {gemm.name}"
                         for (op, cols, inner), gemm in self.chosen.items())

    def __repr__(self) -> str:
        return f"MeasuredGroupedGemm({self.describe()})"


@dataclass(frozen=True)
class GemmProblem:
    """What a layer will multiply, for measured selection.

    shapes_nk: the ``(cols, inner)`` of each projection's weights; the expert block: ``((2F, H), (H, F))``
        (the field's name predates DESIGN.md's notation and is kept for callers).
    rows_per_group: the typical rows of one group (e.g. tokens per rank * top-k / groups); timed at the next
        power of two, rounded up to the segment alignment.
    grad_dtype: the dtype wgrad writes the home experts' gradients in (the layer's `expert_grad_dtype`;
        slot gradients are fp32 either way); None: the activations' dtype promoted to at least fp32.
    groups: the ``(home, slot)`` groups of one call (the layer's ``(epn, B)``); timed on
        ``timed_groups`` of them, in that ratio.
    fresh_home_grads: how the layer calls wgrad: True ("param" mode) with the home part None (the backend
        makes it) and the fp32 slot gradients overwritten; False ("main_grad" mode) adding into home
        gradients of ``grad_dtype`` and fp32 slot gradients.
    """

    shapes_nk: tuple[tuple[int, int], ...]
    rows_per_group: int
    grad_dtype: torch.dtype | None = None
    groups: tuple[int, int] = (8, 0)
    fresh_home_grads: bool = False


Timer = Callable[[str, int, int, int, tuple[int, int], Sequence[GroupedGemm]], Sequence[float]]
"""``timer(op, cols, inner, rows_per_group, (home, slot) groups, backends)`` -> seconds of one ``op`` call
per backend."""


class ChoiceCache:
    """Measured winners by key: in this process, and in a JSON file ``{key: backend name}`` that later
    processes read instead of timing again (``path`` None: this process only). A write merges with the
    file and replaces it atomically; an unreadable file counts as empty, an unwritable one warns."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._choices: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        if key not in self._choices and self.path is not None:
            self._choices = {**self._read(), **self._choices}
        return self._choices.get(key)

    def put(self, key: str, name: str) -> None:
        self._choices[key] = name
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
                json.dump({**self._read(), key: name}, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, self.path)
        except OSError as error:
            warnings.warn(f"grouped-GEMM choice not saved to {self.path}: {error}", stacklevel=2)

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


_DEFAULT_CACHE: ChoiceCache | None = None
_MEASURE_LOCK = threading.Lock()  # thread-ranks build their layers at once: one times, the others read


def default_choice_cache() -> ChoiceCache:
    """The process's cache; its file is ``$MOONEP_MOE_CACHE/gemm.json``, per user by default
    (``$XDG_CACHE_HOME/moonep-moe``, else ``~/.cache/moonep-moe``), none with ``MOONEP_MOE_CACHE=off``."""
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is None:
        user_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        folder = os.environ.get("MOONEP_MOE_CACHE", str(Path(user_cache) / "moonep-moe"))
        _DEFAULT_CACHE = ChoiceCache(None if folder == "off" else Path(folder) / "gemm.json")
    return _DEFAULT_CACHE


def rows_bucket(rows_per_group: int, align: int) -> int:
    """The rows per group timed for ``rows_per_group``: the next power of two, rounded up to ``align``."""
    rows = 1 << max(rows_per_group - 1, 0).bit_length()
    return -(-rows // align) * align


MAX_TIMED_GROUPS = 32
"""Enough groups that a grouped GEMM's scheduling and tails show (8 said little about 256 groups)."""
TIMING_BYTES = 6 << 30
"""Cap on the tensors one timing allocates (``timed_groups``)."""


def timed_groups(problem: GemmProblem, cols: int, inner: int, rows: int) -> tuple[int, int]:
    """The ``(home, slot)`` groups timed for one weight shape: ``min(G, MAX_TIMED_GROUPS)`` in the ratio of
    ``problem.groups``, fewer where one group's tensors times that count would pass ``TIMING_BYTES`` (bf16
    rows of x and dy, and at most a bf16 weight or made gradient plus an fp32 gradient per group:
    ``2 rows (cols + inner) + 6 cols inner`` bytes; DeepSeek-V3's gate_up at 256 rows: 182 MB, so all 32
    groups); at least one group."""
    home, slots = problem.groups
    per_group = 2 * rows * (cols + inner) + 6 * cols * inner
    timed = max(1, min(home + slots, MAX_TIMED_GROUPS, TIMING_BYTES // per_group))
    timed_home = min(home, max(1 if home else 0, timed * home // max(home + slots, 1)))
    return timed_home, timed - timed_home


def measure_grouped_gemm(backends: Sequence[GroupedGemm], problem: GemmProblem, context: str, timer: Timer,
                         cache: ChoiceCache, align: int = 1) -> MeasuredGroupedGemm:
    """For every primitive and weight shape of ``problem``: the cached winner, or the fastest by ``timer`` of
    the backends that compute that primitive themselves (then cached).

    Args:
        backends: the candidates; the first is also the fallback for shapes not measured.
        context: what else the speed depends on (device name, versions, dtype); part of every cache key,
            with the primitive, ``cols`` (``n=`` in the key), ``inner`` (``k=``), the timed rows per group,
            the timed ``(home, slot)`` groups (``groups=h+s``), the candidates' names and, for wgrad,
            ``problem.grad_dtype`` where it is given and the mode (``fresh`` or ``add``). Keys without
            ``groups=`` (before wgrad was timed in the layer's mode, on 8 groups) are never read again.
        timer: ``timer(op, cols, inner, rows_per_group, groups, backends)`` -> seconds each (``cuda_timer``
            on a GPU).
        cache: where winners are looked up and stored.
        align: the segment alignment (``token_padding``); the timed rows per group are a multiple of it.
    """
    by_name = {gemm.name: gemm for gemm in backends}
    rows = rows_bucket(problem.rows_per_group, align)
    where = str(cache.path) if cache.path is not None else "this process only (MOONEP_MOE_CACHE=off)"
    chosen, timed = {}, 0
    with _MEASURE_LOCK:
        for op, (cols, inner) in itertools.product(OPS, dict.fromkeys(problem.shapes_nk)):
            rivals = [gemm for gemm in backends if op in gemm.ops]
            if not rivals:
                continue
            names = "/".join(gemm.name for gemm in rivals)
            groups = timed_groups(problem, cols, inner, rows)
            key = f"{context}|{op}|n={cols}|k={inner}|rows={rows}|groups={groups[0]}+{groups[1]}|{names}"
            if op == "wgrad" and problem.grad_dtype is not None:
                key += f"|grad={str(problem.grad_dtype).removeprefix('torch.')}"
            if op == "wgrad":
                key += "|fresh" if problem.fresh_home_grads else "|add"
            name = cache.get(key) if len(rivals) > 1 else rivals[0].name
            if name not in by_name:
                logger.info("grouped_gemm=auto: timing %s %s on [%d, %d] weights, %d + %d groups of %d rows "
                            "(%s), once: the winner is kept in %s", names, op, cols, inner, *groups, rows,
                            context, where)
                start = time.perf_counter()
                timings = list(zip(timer(op, cols, inner, rows, groups, rivals), names.split("/"),
                                   strict=True))
                name = min(timings)[1]
                logger.info("grouped_gemm=auto: %s %dx%d -> %s (%s; timed in %.1f s)", op, cols, inner, name,
                            ", ".join(f"{rival} {t * 1e3:.3f} ms" for t, rival in timings),
                            time.perf_counter() - start)
                cache.put(key, name)
                timed += 1
            chosen[(op, cols, inner)] = by_name[name]
    gemm = MeasuredGroupedGemm(chosen, fallback=backends[0])
    logger.info("grouped_gemm=auto (%s, %d rows per group): %s; %d timed, the rest from the cache %s "
                "(MOONEP_MOE_CACHE=<folder> moves it, =off disables it)", context, rows,
                gemm.describe(), timed, where)
    return gemm


def choice_context(device_name: str, dtype: torch.dtype) -> str:
    """What a measured choice depends on besides the problem: the device's name, the torch and Triton
    versions and the dtype (the first part of every ``ChoiceCache`` key)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"{device_name}|torch {torch.__version__}|triton {triton_version}|{dtype}".replace("torch.", "")


def cuda_timer(device: torch.device, dtype: torch.dtype, grad_dtype: torch.dtype, fresh_home_grads: bool,
               warmup: int = 2, repeat: int = 5) -> Timer:
    """A ``Timer`` on synthetic uniform segments of the given rows and groups, random data, the weights as
    one tensor, wgrad as the layer calls it (``timed_calls``); mean seconds over ``repeat`` calls after
    ``warmup`` (compilation, autotuning), CUDA events. A backend that raises is reported and counts as
    infinitely slow."""

    def timer(op: str, cols: int, inner: int, rows: int, groups: tuple[int, int],
              backends: Sequence[GroupedGemm]) -> list[float]:
        calls = timed_calls(op, cols, inner, rows, groups, backends, device, dtype, grad_dtype,
                            fresh_home_grads)
        return [_cuda_seconds(call, warmup, repeat, f"{gemm.name} {op} {cols}x{inner}")
                for call, gemm in zip(calls, backends, strict=True)]

    return timer


def timed_calls(op: str, cols: int, inner: int, rows: int, groups: tuple[int, int],
                backends: Sequence[GroupedGemm], device: torch.device, dtype: torch.dtype,
                grad_dtype: torch.dtype, fresh_home_grads: bool) -> list[Callable[[], object]]:
    """One call of ``op`` per backend on ``home + slot`` groups of ``rows`` rows each. wgrad runs the way the
    layer runs it: with ``fresh_home_grads`` the home part None (made by the backend) and the fp32 (or
    wider) slot gradients overwritten; else adding into home gradients of ``grad_dtype`` and the slot
    gradients."""
    home, slots = groups
    offs_g = torch.arange(1, home + slots + 1, dtype=torch.int32, device=device) * rows
    x = torch.randn((home + slots) * rows, inner, device=device, dtype=dtype)
    dy = torch.randn((home + slots) * rows, cols, device=device, dtype=dtype)
    if op == "wgrad":
        slot_dtype = torch.promote_types(dtype, torch.float32)
        slot_grads = torch.zeros(slots, cols, inner, device=device, dtype=slot_dtype)
        if fresh_home_grads:
            return [lambda g=gemm: g.wgrad(dy, x, offs_g, (None, slot_grads), accumulate=False)
                    for gemm in backends]
        home_grads = torch.zeros(home, cols, inner, device=device, dtype=grad_dtype)
        return [lambda g=gemm: g.wgrad(dy, x, offs_g, (home_grads, slot_grads), accumulate=True)
                for gemm in backends]
    w = torch.randn(home + slots, cols, inner, device=device, dtype=dtype) / inner**0.5
    a = x if op == "fwd" else dy
    return [lambda g=gemm: getattr(g, op)(a, (w,), offs_g) for gemm in backends]


def _cuda_seconds(call: Callable[[], object], warmup: int, repeat: int, what: str) -> float:
    try:
        for _ in range(warmup):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            call()
        end.record()
        end.synchronize()
    except Exception as error:  # noqa: BLE001 - a candidate that fails here is not chosen
        warnings.warn(f"grouped-GEMM candidate {what} failed while timed: {error!r}", stacklevel=2)
        return float("inf")
    return start.elapsed_time(end) / 1e3 / repeat


def select_grouped_gemm(
    name: str, device: torch.device, dtype: torch.dtype, k: int | None = None,
    token_padding: int | None = None, problem: GemmProblem | None = None,
) -> GroupedGemm:
    """The one place a grouped-GEMM backend is chosen.

    Args:
        name: "auto", "torch", "reference", "deep_gemm" (fwd and dgrad on DeepGEMM, wgrad on torch; bf16,
            CUDA sm90+, segments aligned to 128) or "triton" (wgrad on the Triton kernel, fwd and dgrad on
            torch; CUDA). "auto": on CUDA with a ``problem``, every backend that can run there (the reference
            excluded) is timed per primitive and weight shape, once per device, dtype, rows-per-group
            bucket, timed groups and wgrad mode (``measure_grouped_gemm`` on ``problem.groups`` and
            ``problem.fresh_home_grads``, cached in process and in ``default_choice_cache()``'s file);
            elsewhere torch where it supports the case, else the reference.
        device, dtype: where and in what dtype the expert activations and weights live.
        k: the row length every operand will have, for the 16-byte stride check (a GEMM size, not the top-k
            of DESIGN.md's notation; the keyword is kept for callers). The expert block uses both H and F as
            row lengths: pass ``math.gcd(H, F)``. None skips the check.
        token_padding: the segments' alignment (DeepGEMM needs a multiple of 128).
        problem: the shapes, typical rows, groups and wgrad mode to measure "auto" on (the expert block:
            ``GemmProblem(((2F, H), (H, F)), rows_per_group, grad_dtype, (epn, B), fresh_home_grads)``).

    Raises:
        ValueError naming ``grouped_gemm`` for an unknown name, or a backend that cannot run here.
    """
    if name == "reference":
        return ReferenceGroupedGemm()
    if name not in GROUPED_GEMM_NAMES:
        raise ValueError(f"grouped_gemm must be one of {GROUPED_GEMM_NAMES}, got {name!r}")
    reasons = {
        "torch": lambda: _torch_unsupported_reason(device, dtype, k),
        "deep_gemm": lambda: deep_gemm_unsupported_reason(device, dtype, token_padding),
        "triton": lambda: _triton_unsupported_reason(device, dtype, k),
    }
    makers = {"torch": TorchGroupedGemm, "deep_gemm": DeepGemmGroupedGemm, "triton": TritonGroupedGemm}
    if name != "auto":
        reason = reasons[name]()
        if reason is not None:
            raise ValueError(f"grouped_gemm={name!r} cannot run here: {reason}; use 'auto' or 'reference'")
        return makers[name]()
    if device.type == "cuda" and problem is not None:
        backends = [makers[backend]() for backend, reason in reasons.items() if reason() is None]
        if len(backends) > 1:
            problem = dataclasses.replace(
                problem, grad_dtype=problem.grad_dtype or torch.promote_types(dtype, torch.float32))
            context = choice_context(torch.cuda.get_device_name(device), dtype)
            timer = cuda_timer(device, dtype, problem.grad_dtype, problem.fresh_home_grads)
            gemm = measure_grouped_gemm(backends, problem, context, timer, default_choice_cache(),
                                        align=token_padding or 1)
            logger.info("grouped_gemm=auto: the first forward + backward compiles the Triton (and DeepGEMM) "
                        "kernels it uses, once per shape; both keep them on disk for later processes")
            return gemm
    return ReferenceGroupedGemm() if reasons["torch"]() is not None else TorchGroupedGemm()
