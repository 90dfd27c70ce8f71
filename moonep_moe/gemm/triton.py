"""The Triton wgrad backend: weight gradients on this package's Triton kernel (`gemm.kernels.wgrad`), fwd and
dgrad on torch; and whether the Triton FP8 GEMM can run (`Fp8GroupedGemm`'s `kernel='triton'`)."""

from collections.abc import Sequence

import torch
from torch import Tensor

from moonep_moe.base.triton import triton_missing_reason
from moonep_moe.gemm import torch_native
from moonep_moe.gemm.base import SlotsReady, _wgrad_parts
from moonep_moe.gemm.torch_native import TorchGroupedGemm


class TritonGroupedGemm:
    """wgrad on the Triton kernel (`moonep_moe.gemm.kernels.wgrad`): ``dy^T x`` accumulated in fp32 and
    written once into the gradients (fp32, or the parameters' dtype), overwrite or add, without the bf16
    product pass of ``torch._grouped_mm``; no host sync. fwd and dgrad are ``TorchGroupedGemm``'s.

    bf16 or fp16 inputs, on CUDA (on CPU only under Triton's interpreter, for tests). The first wgrad per
    weight shape autotunes the kernel's tiles (host syncs then; measured selection does it at construction).
    """

    name = "triton"
    ops = ("wgrad",)
    joined_weights = True

    def __init__(self) -> None:
        from moonep_moe.gemm.kernels.wgrad import grouped_wgrad_triton

        self._wgrad = grouped_wgrad_triton
        self._torch = TorchGroupedGemm()

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        return self._torch.fwd(x, weights, offs_g, slots_ready)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        return self._torch.dgrad(dy, weights, offs_g, slots_ready)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        parts = _wgrad_parts(dy, x, offs_g, out, accumulate)
        self._wgrad(dy, x, offs_g, parts, accumulate, slot_groups_from=parts[0].shape[0])
        return parts


def unsupported_reason(device: torch.device, dtype: torch.dtype, k: int | None = None,
                       token_padding: int | None = None) -> str | None:
    """Why the Triton wgrad (and torch fwd and dgrad) cannot run this case, or None when it can."""
    if device.type != "cuda":
        return f"the Triton wgrad runs on CUDA, got {device.type}"
    # fwd and dgrad run on torch
    return torch_native.unsupported_reason(device, dtype, k) or triton_missing_reason()


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why the Triton FP8 grouped GEMM cannot run on a CUDA ``device``, or None (it runs where Triton
    does)."""
    return triton_missing_reason()
