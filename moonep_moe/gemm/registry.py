"""The grouped-GEMM backends as one table, and the one place that chooses among them.

Each backend is one module (`torch_native`, `reference`, `deep_gemm`, `triton`) and one `GemmBackend` row in
`BACKENDS`: its config name, how it is built, why it cannot run here, the segment alignment it needs and
whether it has an FP8 grouped GEMM (`Fp8GroupedGemm`'s kernels). `MoEConfig.grouped_gemm` takes its choices
from this table (`GROUPED_GEMM_NAMES`), `"auto"` times the rows that can run, and the FP8 layer picks its
kernel from the rows marked FP8. Adding a backend: one module with a `GroupedGemm` class and an
`unsupported_reason`, plus one row here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from moonep_moe.base.sizes import BLOCK_TOKEN_PADDING, TOKEN_PADDING
from moonep_moe.base.triton import triton_missing_reason
from moonep_moe.gemm import deep_gemm, torch_native, triton
from moonep_moe.gemm.autotune import choice_context, cuda_timer, default_choice_cache, measure_grouped_gemm
from moonep_moe.gemm.base import GemmProblem, GroupedGemm
from moonep_moe.gemm.fp8 import Fp8GroupedGemm, ReferenceFp8Gemm
from moonep_moe.gemm.reference import ReferenceGroupedGemm
from moonep_moe.transport.world import EPWorld

logger = logging.getLogger(__name__)  # a child of "moonep_moe"

UnsupportedReason = Callable[[torch.device, torch.dtype, "int | None", "int | None"], "str | None"]
"""`(device, dtype, k, token_padding) -> why the backend cannot run there, or None`."""


def _runs_anywhere(device: torch.device, dtype: torch.dtype, k: int | None = None,
                   token_padding: int | None = None) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class GemmBackend:
    """One row of the table: a grouped-GEMM backend.

    Attributes:
        name: its `MoEConfig.grouped_gemm` value.
        build: makes the `GroupedGemm`.
        unsupported_reason: why it cannot run a case, or None.
        token_padding: the segment alignment it needs, the layer's default `token_padding` with it.
        timed: whether `"auto"` times it (the reference is the correctness oracle, never fast).
        fp8_unsupported_reason: for a library that also runs `Fp8GroupedGemm`'s FP8 GEMM (its `kernel` of
            the same name), why that cannot run on a CUDA device, or None; the FP8 layer takes the first row
            whose FP8 GEMM can run, in table order. None: no FP8 GEMM.
    """

    name: str
    build: Callable[[], GroupedGemm]
    unsupported_reason: UnsupportedReason
    token_padding: int = TOKEN_PADDING
    timed: bool = True
    fp8_unsupported_reason: Callable[[torch.device], str | None] | None = None


BACKENDS: dict[str, GemmBackend] = {backend.name: backend for backend in (
    GemmBackend("torch", torch_native.TorchGroupedGemm, torch_native.unsupported_reason),
    GemmBackend("reference", ReferenceGroupedGemm, _runs_anywhere, timed=False),
    GemmBackend("deep_gemm", deep_gemm.DeepGemmGroupedGemm, deep_gemm.unsupported_reason,
                token_padding=BLOCK_TOKEN_PADDING, fp8_unsupported_reason=deep_gemm.fp8_unsupported_reason),
    GemmBackend("triton", triton.TritonGroupedGemm, triton.unsupported_reason,
                fp8_unsupported_reason=triton.fp8_unsupported_reason),
)}
"""Every grouped-GEMM backend by name; where no faster one can run, `"auto"` takes `"torch"`, then the
reference."""
GROUPED_GEMM_NAMES = ("auto", *BACKENDS)
"""`MoEConfig.grouped_gemm`'s choices: `"auto"` and every backend."""


def select_grouped_gemm(
    name: str, device: torch.device, dtype: torch.dtype, k: int | None = None,
    token_padding: int | None = None, problem: GemmProblem | None = None, world: EPWorld | None = None,
) -> GroupedGemm:
    """The one place a grouped-GEMM backend is chosen.

    Args:
        name: "auto" or a `BACKENDS` name: "torch", "reference", "deep_gemm" (fwd, dgrad and the home
            experts' wgrad on DeepGEMM; bf16, CUDA sm90+, segments aligned to 128) or "triton" (wgrad on
            the Triton kernel, fwd and dgrad on torch; CUDA). "auto": on CUDA with a ``problem``, every
            timed backend that can run there is timed per primitive and weight shape, once per device, dtype,
            rows-per-group bucket, timed groups and wgrad mode (``measure_grouped_gemm`` on
            ``problem.groups`` and ``problem.fresh_home_grads``, cached in process and in
            ``default_choice_cache()``'s file); elsewhere torch where it supports the case, else the
            reference.
        device, dtype: where and in what dtype the expert activations and weights live.
        k: the row length every operand will have, for the 16-byte stride check (a GEMM size, not the top-k
            of DESIGN.md's notation; the keyword is kept for callers). The expert block uses both H and F as
            row lengths: pass ``math.gcd(H, F)``. None skips the check.
        token_padding: the segments' alignment (DeepGEMM needs a multiple of 128).
        problem: the shapes, typical rows, groups and wgrad mode to measure "auto" on (the expert block:
            ``GemmProblem(((2F, H), (H, F)), rows_per_group, grad_dtype, (epn, B), fresh_home_grads)``).
        world: the EP group of the layer: where "auto" measures, every rank runs rank 0's choices
            (collective; ``autotune.agreed_choices``).

    Raises:
        ValueError naming ``grouped_gemm`` for an unknown name, or a backend that cannot run here.
    """
    if name not in GROUPED_GEMM_NAMES:
        raise ValueError(f"grouped_gemm must be one of {GROUPED_GEMM_NAMES}, got {name!r}")
    if name != "auto":
        backend = BACKENDS[name]
        reason = backend.unsupported_reason(device, dtype, k, token_padding)
        if reason is not None:
            raise ValueError(f"grouped_gemm={name!r} cannot run here: {reason}; use 'auto' or 'reference'")
        return backend.build()
    runnable = [backend for backend in BACKENDS.values()
                if backend.timed and backend.unsupported_reason(device, dtype, k, token_padding) is None]
    if device.type == "cuda" and problem is not None and len(runnable) > 1:
        problem = dataclasses.replace(
            problem, grad_dtype=problem.grad_dtype or torch.promote_types(dtype, torch.float32))
        context = choice_context(torch.cuda.get_device_name(device), dtype)
        timer = cuda_timer(device, dtype, problem.grad_dtype, problem.fresh_home_grads)
        gemm = measure_grouped_gemm([b.build() for b in runnable], problem, context, timer,
                                    default_choice_cache(), align=token_padding or 1, world=world)
        logger.info("grouped_gemm=auto: the first forward + backward compiles the Triton (and DeepGEMM) "
                    "kernels it uses, once per shape; both keep them on disk for later processes")
        return gemm
    return (BACKENDS["torch"] if BACKENDS["torch"] in runnable else BACKENDS["reference"]).build()


def fp8_unsupported_reason(device: torch.device, dtype: torch.dtype, token_padding: int | None) -> str | None:
    """Why `Fp8GroupedGemm` cannot run here, or None when it can: bf16 on CUDA, segments aligned to 128 rows,
    FP8 tensor cores (sm89 or newer) and Triton (the casts, and the GEMM where DeepGEMM cannot run)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return f"FP8 experts run bf16 weights and activations on CUDA, got {dtype} on {device.type}"
    if token_padding is None or token_padding % 128:
        return f"FP8 GEMMs need segments aligned to 128 rows (token_padding % 128 == 0), got {token_padding}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"FP8 tensor cores need sm89 or newer, got sm{capability[0]}{capability[1]}"
    missing = triton_missing_reason()
    return None if missing is None else f"{missing}; the FP8 casts and GEMMs are Triton kernels"


def fp8_kernel(device: torch.device) -> str:
    """The FP8 GEMM a CUDA ``device`` runs: the first `BACKENDS` row whose FP8 GEMM can run there ("deep_gemm"
    on sm90 where DeepGEMM imports, the faster, measured in `bench.gemm`; else "triton")."""
    return next(backend.name for backend in BACKENDS.values()
                if backend.fp8_unsupported_reason is not None
                and backend.fp8_unsupported_reason(device) is None)


def fp8_grouped_gemm(wgrad: GroupedGemm, device: torch.device, dtype: torch.dtype, token_padding: int | None,
                     rank: int = 0, fp8_wgrad: bool = False) -> Fp8GroupedGemm:
    """The FP8 backend of a ``precision="fp8"`` layer, its weight gradients on ``wgrad`` (bf16), or with
    ``fp8_wgrad`` as FP8 GEMMs on DeepGEMM.

    Raises:
        ValueError naming ``precision`` or ``fp8_wgrad`` (and the rank) when FP8 cannot run here.
    """
    reason = fp8_unsupported_reason(device, dtype, token_padding)
    if reason is not None:
        raise ValueError(f"precision='fp8' cannot run here (rank {rank}): {reason}; use precision='bf16'")
    kernel = fp8_kernel(device)
    if fp8_wgrad and kernel != "deep_gemm":
        raise ValueError(f"fp8_wgrad=True cannot run here (rank {rank}): it needs DeepGEMM's sm90 FP8 "
                         f"GEMMs, and the FP8 GEMM here is the {kernel!r} one (DeepGEMM not installed, or "
                         "not an sm90 GPU); use fp8_wgrad=False")
    if kernel == "triton":
        _warn_triton_training()
    return Fp8GroupedGemm(wgrad, kernel, fp8_wgrad)


@functools.cache
def _warn_triton_training() -> None:
    """Once a process: fp8 training on the Triton FP8 GEMM is slower than bf16."""
    logger.warning("precision='fp8' trains on the Triton FP8 GEMM here (DeepGEMM is not installed, or the "
                   "GPU is not sm90): about half DeepGEMM's rate, so fp8 training is slower than bf16 "
                   "(docs/precision.md, 'When it pays'); on Hopper, install DeepGEMM (the [gpu] extra)")


def fp8_weights_gemm(grouped_gemm: str, device: torch.device, dtype: torch.dtype, token_padding: int | None,
                     rank: int = 0) -> Fp8GroupedGemm | ReferenceFp8Gemm:
    """The GEMM backend of an ``expert_weights="fp8"`` layer: `ReferenceFp8Gemm` for ``grouped_gemm=
    "reference"``, else the FP8 GEMMs (`Fp8GroupedGemm`, no weight gradients).

    Raises:
        ValueError naming ``expert_weights`` and the rank when the FP8 GEMMs cannot run here.
    """
    if grouped_gemm == "reference":
        return ReferenceFp8Gemm()
    reason = fp8_unsupported_reason(device, dtype, token_padding)
    if reason is not None:
        raise ValueError(f"expert_weights='fp8' with grouped_gemm={grouped_gemm!r} cannot run here (rank "
                         f"{rank}): {reason}; use grouped_gemm='reference' (dequantised weights, any device)")
    return Fp8GroupedGemm(None, fp8_kernel(device))
