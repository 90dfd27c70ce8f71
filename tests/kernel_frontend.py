"""Compile the Triton kernels for sm90 on a machine without a GPU: run as a script, with Triton's
interpreter off (`tests/test_kernel_frontend.py` starts it in a subprocess).

The interpreter runs a kernel as Python, so code that the compiler rejects can pass every CPU test: a
`return` under a constexpr-true `if` followed by more code once built `peer` on a local tensor and failed
every one-rank dispatch on the H200 ("cannot cast fp32[] to pointer<bf16>") while the interpreter ran it; the
one-program decode plan passed the interpreter and Triton 3.9 and crashed Triton 3.6's TritonGPU coalescing
pass (an LLVM assertion) on the H200. Here every launcher of the comm row kernels, the planner, the
histogram, the SwiGLU and the FP8 casts, the grouped wgrad kernel (one autotuner tile) and the slot groups'
GEMM, is called on
small CPU tensors, in each variant it has (one rank or several, with and without route weights, bf16 and
fp32 rows, FP8 dispatch's packed uint8 rows, the FP8 casts' orientations), with the kernels' `[grid]` launch
replaced by a recorder; each recorded launch (its real argument types, constexpr values and warps) is then
compiled all the way to PTX for an sm90 target (Triton's IR passes, its bundled LLVM and ptxas), which is
where such errors are raised. Nothing runs. CI runs it under the newest Triton and the oldest the package
allows (the H200's).

The compiled FP8 casts, and the SwiGLU kernels that write FP8 rows, must hold sm90's hardware e4m3
conversion (`HARDWARE_E4M3`): they round with it, not with the integer path the interpreter needs.

Prints one line per launch and exits non-zero if any fails to compile.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with Triton's interpreter off"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from moonep_moe.transport.world import SymmetricTensor  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
         torch.float8_e4m3fn: "fp8e4nv"}
launches: list[tuple[str, JITFunction, tuple, dict]] = []


def record(self: JITFunction, grid):
    """`kernel[grid]`: a launcher that records the call instead of running it."""
    def launch(*args, **kwargs):
        launches.append((current, self, args, kwargs))
    return launch


def signature(kernel: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """The kernel's `(signature, constexprs)` for these launch arguments, as Triton's launcher would type
    them (tensors by dtype, Python ints as i32 or i64, floats as fp32, bools as i1, tensor descriptors as
    Triton types them)."""
    names = kernel.arg_names
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    sig, constexprs = {}, {}
    for index, name in enumerate(names):
        value = values[name]
        value = value.value if isinstance(value, triton.language.constexpr) else value  # as the launcher does
        if index in kernel.constexprs:
            sig[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, TensorDescriptor):
            sig[name] = mangle_type(value)
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
    return sig, constexprs


def compile_sm90(kernel: JITFunction, sig: dict, constexprs: dict, kwargs: dict) -> str:
    """The kernel compiled to PTX for sm90 with these argument types and the launch's warps and stages;
    returns the PTX."""
    source = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    options = {name: kwargs[name] for name in ("num_warps", "num_stages") if name in kwargs}
    return triton.compile(source, target=TARGET, options=options).asm["ptx"]


def symmetric(name: str, tensors: list[torch.Tensor], rank: int = 0) -> SymmetricTensor:
    return SymmetricTensor(name, rank, tuple(tensors))


def comm_launches() -> None:
    """Every row-kernel launcher, one rank and two ranks, with and without weights."""
    global current
    from moonep_moe.comm.exchange import as_words
    from moonep_moe.comm.kernels import experts, rows
    from moonep_moe.fp8 import wire as fp8_rows
    from moonep_moe.plan import histogram

    H, K, S, nvs = 64, 4, 8, 256
    dst_n = torch.zeros(S * K, dtype=torch.int32)
    zero_fill = torch.zeros(12, 2, dtype=torch.int32)  # 12 groups' padding, zeroed by send_routes (tp 16)
    for dtype in (torch.bfloat16, torch.float32):
        for ranks in (1, 2):
            def sym(name, shape, dtype=dtype, ranks=ranks):
                return symmetric(name, [torch.zeros(shape, dtype=dtype) for _ in range(ranks)])

            rows_t, weights_t = sym("rows", (nvs, H)), sym("weights", (nvs,), torch.float32)
            pairs_t = sym("pairs", (ranks * S * K, 2), torch.int32)
            hidden = torch.zeros(S, H, dtype=dtype)
            for weighted in (True, False):
                current = f"send_routes {dtype} R={ranks} weights={weighted}"
                rows.send_routes(hidden, torch.zeros(S, K) if weighted else None, dst_n, weighted, rows_t,
                                 weights_t, pairs_t, 0, zero_fill, 16)
                current = f"gather_routes {dtype} R={ranks} weights={weighted}"
                rows.gather_routes(dst_n, rows_t, weights_t if weighted else None,
                                   torch.zeros(S, H, dtype=dtype), torch.zeros(S, K) if weighted else None,
                                   torch.float32)
    for ranks in (1, 2):  # FP8 dispatch: packed e4m3 rows + scales as uint8 rows (`fp8.wire`)
        width = fp8_rows.packed_width(H)
        packed_t = symmetric("rows", [torch.zeros(nvs, width, dtype=torch.uint8) for _ in range(ranks)])
        weights_t = symmetric("weights", [torch.zeros(nvs) for _ in range(ranks)])
        pairs_t = symmetric("pairs", [torch.zeros(ranks * S * K, 2, dtype=torch.int32) for _ in range(ranks)])
        current = f"send_routes fp8 packed R={ranks}"
        rows.send_routes(torch.zeros(S, width, dtype=torch.uint8), torch.zeros(S, K), dst_n, True, packed_t,
                         weights_t, pairs_t, 0, zero_fill, 16)
    current = "expand_duplicates fp8 packed"
    rows.expand_duplicates(packed_t.local, torch.zeros(nvs, 3, dtype=torch.int32),
                           torch.zeros(nvs, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), K - 1, 16,
                           num_sms=4)
    current = "record_duplicates"
    int32 = dict(dtype=torch.int32)
    rows.record_duplicates(torch.full((2 * S * K, 2), -1, **int32), torch.zeros(nvs, **int32),
                           torch.zeros(1, **int32), torch.zeros(nvs, 3, **int32), torch.zeros(nvs, **int32),
                           torch.zeros(2, **int32), K)
    current = "copy_rows"
    rows.copy_rows(torch.zeros(nvs, H, dtype=torch.bfloat16), torch.zeros(nvs, H, dtype=torch.bfloat16),
                   torch.zeros(1, dtype=torch.int32), num_sms=4)
    for view in fp8_rows.unpack_rows(packed_t.local, H):  # a copying FP8 dispatch: e4m3 rows, scales
        current = f"copy_rows fp8 packed {view.dtype}"
        rows.copy_rows(*as_words(torch.empty(view.shape, dtype=view.dtype), view),
                       torch.zeros(1, dtype=torch.int32), num_sms=4)
    current = "expert_histogram"
    histogram.expert_histogram_triton(torch.zeros(S, K, dtype=torch.int32), 12)
    dup_groups, dup_loffs = torch.zeros(nvs, 3, **int32), torch.zeros(nvs, **int32)
    for dtype in (torch.bfloat16, torch.float32):
        current = f"expand_duplicates {dtype}"
        rows.expand_duplicates(torch.zeros(nvs, H, dtype=dtype), dup_groups, dup_loffs,
                               torch.zeros(2, **int32), K - 1, 16, num_sms=4)
        current = f"pre_reduce_duplicates {dtype}"
        rows.pre_reduce_duplicates(torch.zeros(nvs, H, dtype=dtype), dup_groups, dup_loffs,
                                   torch.zeros(2, **int32), K - 1, 16, torch.float32, num_sms=4)
        for ranks in (1, 2):
            home = symmetric("home", [torch.zeros(3, 8, 16, dtype=dtype) for _ in range(ranks)])
            current = f"copy_experts {dtype} R={ranks}"
            experts.copy_experts(home, torch.zeros(2, 8, 16, dtype=dtype), torch.tensor([0, -1], **int32))
            slots = symmetric("slots", [torch.zeros(2, 8, 16) for _ in range(ranks)])
            current = f"add_replicas {dtype} R={ranks}"
            experts.add_replicas(torch.zeros(3, 8, 16, dtype=dtype), slots, torch.full((3, ranks), -1, **int32))  # noqa: E501
        current = f"clear_slots {dtype}"
        experts.clear_slots(torch.zeros(2, 8, 16, dtype=dtype), torch.tensor([0, -1], **int32))


def plan_launches() -> None:
    """The planner's launches: one rank as one fused program (a decode step) and as two launches, counting
    its routes or given them, two ranks, and groups of DeepSeek-V3's E at R = 8 to 128 (the global
    program's tiles grow with R)."""
    global current
    from moonep_moe.plan import triton as plan

    K = 4
    shapes = ((1, 16, 1, True), (1, 16, 40, True), (1, 16, 40, False), (2, 16, 40, False),
              (8, 256, 40, False), (32, 256, 40, False), (64, 256, 40, False),
              (128, 256, 40, False))
    for ranks, E, tokens, count in shapes:
        counts_re = torch.zeros(ranks, E, dtype=torch.int64)
        launch = plan.prepare(counts_re, torch.zeros(tokens, K, dtype=torch.int64), rank=0,
                              num_slots=0 if ranks == 1 else E // ranks, token_padding=16, rows_per_rank=1024,
                              count_routes=count)
        current = f"plan R={ranks} E={E} s={tokens} count_routes={count} fused={launch.constants['FUSED']}"
        launch.plan_group()
        launch.route_destinations()


def swiglu_launches() -> None:
    """The fused SwiGLU, forward and backward, with and without FP8 rows (F = 48 and 384: three 128-column
    tiles of a 512-column block)."""
    global current
    from moonep_moe.layers.kernels import swiglu

    for dtype in (torch.bfloat16, torch.float32):
        ab, w, end = torch.zeros(64, 96, dtype=dtype), torch.zeros(64), torch.tensor([48], dtype=torch.int32)
        current = f"swiglu forward {dtype}"
        swiglu.swiglu_weighted_triton(ab, w, end)
        current = f"swiglu backward {dtype}"
        swiglu.swiglu_weighted_backward_triton(torch.zeros(64, 48, dtype=dtype), ab, w, end)
    ab, u = torch.zeros(64, 768, dtype=torch.bfloat16), torch.zeros(64, 384, dtype=torch.bfloat16)
    current = "swiglu forward, FP8 rows"
    swiglu.swiglu_weighted_fp8_triton(ab, w, end)
    current = "swiglu backward, FP8 rows"
    swiglu.swiglu_weighted_backward_triton(u, ab, w, end, fp8_dab=True)


HARDWARE_E4M3 = "cvt.rn.satfinite.e4m3x2.f32"
"""sm90's fp32 -> e4m3 conversion, round to nearest even: the compiled FP8 casts must round with it."""


def check_hardware_rounding(constexprs: dict, ptx: str) -> None:
    """A compiled FP8 cast takes the hardware path (`HARDWARE_ROUNDING`) and rounds with `HARDWARE_E4M3`."""
    if not constexprs.get("HARDWARE_ROUNDING"):
        raise RuntimeError("launched with HARDWARE_ROUNDING off while compiled")
    if HARDWARE_E4M3 not in ptx:
        raise RuntimeError(f"the compiled cast does not round with {HARDWARE_E4M3}")


def fp8_launches() -> None:
    """The FP8 casts: rows, blocks in each orientation, a weight gradient's operands (a later part of the
    segments); rows back from FP8, from packed rows."""
    global current
    from moonep_moe.fp8 import cast as fp8_cast

    current = "cast_rows"
    fp8_cast.cast_rows(torch.zeros(256, 300, dtype=torch.bfloat16),
                       torch.tensor([128, 256], dtype=torch.int32))
    for orientation in ("q", "qt", "both"):
        current = f"cast_blocks {orientation}"
        w = torch.zeros(2, 256, 384, dtype=torch.bfloat16)
        q = torch.empty(2, 256, 384, dtype=torch.float8_e4m3fn) if orientation != "qt" else None
        qt = torch.empty(2, 384, 256, dtype=torch.float8_e4m3fn) if orientation != "q" else None
        s = torch.empty(2, 2, 3, dtype=torch.float32)
        fp8_cast.cast_blocks(w, s, q, qt)
    current = "cast_blocks, empty groups skipped"
    fp8_cast.cast_blocks(torch.zeros(2, 256, 384, dtype=torch.bfloat16), torch.empty(2, 2, 3),
                         torch.empty(2, 256, 384, dtype=torch.float8_e4m3fn),
                         offs_g=torch.tensor([128, 128, 256], dtype=torch.int32), first_group=1)
    for dtype in (torch.bfloat16, torch.float32):
        current = f"cast_columns {TYPES[dtype]}"
        ends = torch.tensor([128, 128, 256], dtype=torch.int32)
        fp8_cast.cast_columns(torch.zeros(300, 200, dtype=dtype), ends, 1, 3)
    for dtype in (torch.bfloat16, torch.float32):
        current = f"dequantise_rows {TYPES[dtype]}"
        packed = torch.zeros(256, 320, dtype=torch.uint8)  # packed rows of H = 300: e4m3 bytes, then scales
        q, scales = packed[:, :300].view(torch.float8_e4m3fn), packed[:, 300:312].view(torch.float32)
        fp8_cast.dequantise_rows(q, scales, torch.tensor([128, 256], dtype=torch.int32), dtype)


def wgrad_launches() -> None:
    """The grouped wgrad kernel in the first of its autotuner's sm90 tiles (called through the autotuner's
    kernel, `.fn`, which the recorder sees), and the zeroing of an overwritten FP8 wgrad's groups."""
    global current
    from moonep_moe.gemm.kernels import wgrad

    offs = torch.tensor([128, 256], dtype=torch.int32)
    out0, out1 = torch.zeros(1, 64, 96), torch.zeros(1, 64, 96)
    for accumulate in (False, True):
        common = dict(ACCUMULATE=accumulate, SWIZZLE=wgrad.SWIZZLE, INTERPRET_ROWS=0)
        current = f"grouped_wgrad accumulate={accumulate}"
        dy, x = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(256, 96, dtype=torch.bfloat16)
        wgrad._grouped_wgrad_kernel.fn[(1,)](dy, x, offs, out0, out1, 1, 0, 1, 64, 96, 64, 96, out0.stride(0),
                                             out1.stride(0), **common, **wgrad._configs()[0].kwargs)
    current = "zero_filled_groups"
    wgrad.zero_filled_groups(torch.zeros(2, 64, 96), offs)

def groups_from_launches() -> None:
    """The slot groups' GEMM at its sm90 launch shape: bf16 and fp32 outputs (a forward's transposed weights
    and a dgrad's differ in stride values only), and its aligned kernel in both weight layouts."""
    global current
    from moonep_moe.base.sizes import next_power_of_2
    from moonep_moe.gemm.kernels import groups_from

    offs = torch.tensor([128, 200, 256], dtype=torch.int32)
    a, b = torch.zeros(256, 96, dtype=torch.bfloat16), torch.zeros(2, 96, 64, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        current = f"groups_from out {TYPES[dtype]}"
        out = torch.zeros(256, 64, dtype=dtype)
        groups_from._groups_from_kernel[(1,)](a, b, offs, out, 1, 3, 64, 96, a.stride(0), *b.stride(),
                                              out.stride(0), GROUPS_POW2=next_power_of_2(3),
                                              INTERPRET_TILES=0, **groups_from.tiles())
    # the aligned kernel (tensor descriptors), a forward's weights [G, n, k] and a dgrad's [G, k, n]
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    for b_nk, weights in ((True, torch.zeros(2, 256, 128, dtype=torch.bfloat16)),
                          (False, torch.zeros(2, 128, 256, dtype=torch.bfloat16))):
        for dtype in (torch.bfloat16, torch.float32):
            current = f"groups_from aligned b_nk={b_nk} out {TYPES[dtype]}"
            out = torch.zeros(256, 256, dtype=dtype)
            launch = groups_from.aligned_tiles()
            b_gkn = weights.transpose(-2, -1) if b_nk else weights
            groups_from._groups_from_aligned_kernel[(1,)](
                *groups_from._descriptors(a, b_gkn, out, b_nk, launch), offs, 1, 3, 256, 128, B_NK=b_nk,
                GROUPS_POW2=next_power_of_2(3), INTERPRET_TILES=0, **launch)


current = ""


def main() -> int:
    JITFunction.__getitem__ = record
    comm_launches()
    plan_launches()
    swiglu_launches()
    fp8_launches()
    wgrad_launches()
    groups_from_launches()
    failed = 0
    for what, kernel, args, kwargs in launches:
        try:
            sig, constexprs = signature(kernel, args, kwargs)
            ptx = compile_sm90(kernel, sig, constexprs, kwargs)
            if "HARDWARE_ROUNDING" in constexprs and (what.startswith("cast_") or "FP8" in what):
                check_hardware_rounding(constexprs, ptx)
            print(f"ok     {what}: {kernel.__name__}")
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the exit code says it
            failed += 1
            lines = [line for line in str(error).splitlines() if line.strip(" ^")] or [repr(error)]
            print(f"FAILED {what}: {kernel.__name__}: {lines[-1].strip()}")
    print(f"{len(launches)} launches, {failed} failed to compile for sm{TARGET.arch} "
          f"(Triton {triton.__version__})")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
