"""DeepGEMM's grouped GEMMs: its bf16 contiguous-layout kernels for fwd and dgrad, its bf16 k-grouped kernel
for wgrad, and whether its FP8 GEMM can run (`Fp8GroupedGemm`'s `kernel='deep_gemm'`). Optional: the `[gpu]`
extra."""

from collections.abc import Sequence

import torch
from torch import Tensor

from moonep_moe.base.sizes import BLOCK_TOKEN_PADDING
from moonep_moe.gemm.base import (
    OPS,
    SlotsReady,
    _cat_groups,
    _check_groups,
    _wgrad_parts,
    groups_before_wait,
    into,
)


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


def standin_sizes(groups: int, rows: int) -> list[int]:
    """A host list for DeepGEMM's sm90 k-grouped kernels (bf16 and FP8) in place of the segment sizes, which
    live on the device: `groups` multiples of `BLOCK_TOKEN_PADDING` (their segment alignment) summing to
    `rows` (the operands' row capacity, itself a multiple), the blocks dealt evenly. Those kernels read each
    segment's size from the device tensor (their scheduler, and the FP8 kernel's per-segment TMA
    descriptors, rewritten on the device before each segment's first load); the host list sets only the
    group count, the operands' extent (its sum), the first descriptor before that rewrite and the config
    (its largest entry), so a list of the right count and sum gives the true list's results, bit for bit
    (`bench.deep_gemm_wgrad`, the GPU tests)."""
    blocks, extra = divmod(rows // BLOCK_TOKEN_PADDING, groups)
    return [(blocks + (g < extra)) * BLOCK_TOKEN_PADDING for g in range(groups)]


class DeepGemmGroupedGemm:
    """DeepGEMM on Hopper: fwd and dgrad through ``m_grouped_bf16_gemm_{nt,nn}_contiguous`` with
    ``use_psum_layout=True``, which takes the padded segment end offsets (``offs_g``) directly on the device:
    no host sync. Every segment must start at a multiple of 128 (``token_padding`` a multiple of 128). They
    write into a given ``out`` (the kernels take their output tensor). With ``slots_ready`` they compute the
    home groups first and the slot groups after the wait, on the Triton `groups_from` GEMM (`_psum`).

    wgrad: the first part of ``out`` (the home experts' gradients) through the bf16 k-grouped
    ``k_grouped_bf16_gemm_tn_contiguous`` (``d[g] += dy_g^T x_g``), which reads the segment sizes on the
    device; its host list is the fixed stand-in `standin_sizes`, so there is no host read. It sums in fp32 and
    adds the sum into ``d`` with a TMA reduce-add (into a bf16 ``d``: the sum rounded to bf16, then added, as
    ``torch._grouped_mm``'s product then ``.add_``). On sm90 it only adds: a fresh gradient (the default
    mode's) is zeroed first, an overwritten one too. The later parts (the prefetch slots) start at a row known
    only on the device, where the kernel cannot begin: they go to the Triton wgrad, as in
    ``TorchGroupedGemm``. ``dy``, ``x`` and a given first part must be contiguous (ValueError otherwise: the
    layer's always are). A weights sequence of several non-empty parts is joined with
    ``torch.cat`` as in ``TorchGroupedGemm`` (pass one arena tensor to avoid the copy:
    ``ExpertRows.compute_weights``).
    """

    name = "deep_gemm"
    ops = OPS
    joined_weights = True

    def __init__(self) -> None:
        self._deep_gemm = import_deep_gemm()

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        nt = self._deep_gemm.m_grouped_bf16_gemm_nt_contiguous
        return self._psum(nt, x, weights, offs_g, 1, out, slots_ready)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        # DeepGEMM's operand b, [G, K, N] in its own letters, is w as stored: [G, cols, inner]
        nn = self._deep_gemm.m_grouped_bf16_gemm_nn_contiguous
        return self._psum(nn, dy, weights, offs_g, 2, out, slots_ready)

    @staticmethod
    def _psum(kernel, a: Tensor, weights: Sequence[Tensor], offs_g: Tensor, dim: int,
              out: Tensor | None, slots_ready: SlotsReady | None) -> Tensor:
        """`kernel(a, w, d, offs)` on the psum layout into `d`: `out` where it fits (`into`), else a new
        tensor of `w.shape[dim]` columns. With `slots_ready` (home groups and slots both present) the kernel
        computes the home groups alone (``offs_g[:home]``: it writes no row past their end), then the
        slots' weights are waited for and the slot groups, which start at a row known only on the device,
        go to the Triton `groups_from` GEMM on 128-row segments (its aligned kernel)."""
        from moonep_moe.gemm.kernels.groups_from import groups_from_gemm

        _check_groups(weights, offs_g, "weights")
        joined = _cat_groups(weights)
        d = into(out, a.shape[0], joined.shape[dim], a.dtype, a.device)
        home = groups_before_wait(slots_ready, offs_g.numel())
        if not home:
            kernel(a, joined, d, offs_g, use_psum_layout=True)
            return d
        kernel(a, joined[:home], d, offs_g[:home], use_psum_layout=True)
        slots_ready.wait()
        slots = joined[home:]
        groups_from_gemm(a, slots.transpose(-2, -1) if dim == 1 else slots, offs_g, home, d,
                         row_alignment=BLOCK_TOKEN_PADDING)
        return d

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        from moonep_moe.gemm.kernels.wgrad import grouped_wgrad_triton

        for arg, tensor in (("dy", dy), ("x", x), ("out[0]", out[0])):
            if tensor is not None and not tensor.is_contiguous():
                raise ValueError(f"the deep_gemm wgrad needs {arg} contiguous (its kernel's TMA layout), got "
                                 f"strides {tensor.stride()} for shape {list(tensor.shape)}")
        parts = _wgrad_parts(dy, x, offs_g, out, accumulate)
        home = parts[0]
        if not accumulate:  # made or overwritten: the kernel only adds
            home.zero_()
        groups = home.shape[0]
        if groups:
            # every segment ends at a multiple of 128 within dy's rows: the rows up to the last such multiple
            # hold them all, and the kernel's operands must span a multiple of 128 rows
            rows = dy.shape[0] // BLOCK_TOKEN_PADDING * BLOCK_TOKEN_PADDING
            sizes_g = torch.diff(offs_g[:groups], prepend=offs_g.new_zeros(1))
            self._deep_gemm.k_grouped_bf16_gemm_tn_contiguous(dy[:rows], x[:rows], home,
                                                              standin_sizes(groups, rows), sizes_g, home)
        if any(part.shape[0] for part in parts[1:]):
            grouped_wgrad_triton(dy, x, offs_g, parts[1:], accumulate, first_group=groups,
                                 slot_groups_from=groups)
        return parts


def unsupported_reason(device: torch.device, dtype: torch.dtype, k: int | None = None,
                       token_padding: int | None = None) -> str | None:
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
        return f"deep_gemm cannot be imported ({error}); install the 'gpu' extra (README, 'On a GPU')"
    return None


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why DeepGEMM's FP8 grouped GEMM cannot run on a CUDA ``device``, or None: sm90 only (the FP8 layer's
    fp32 scales are DeepGEMM's sm90 layout; sm100 takes UE8M0 scales), bf16 segments of 128 rows."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "the FP8 scales are laid out for DeepGEMM's sm90 kernels"
    return unsupported_reason(device, torch.bfloat16, None, 128)
