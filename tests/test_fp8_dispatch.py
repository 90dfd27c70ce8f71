"""FP8 activations on the wire (dispatch): `Buffer.dispatch(q_sh, ..., scales=scales_sh)`
moves e4m3 rows with their 1x128 fp32 scales (packed byte rows, `fp8.wire`), about half the bytes of
bf16; combine stays bf16.

The contract: dispatch is a copy, so every received e4m3 row and its scales are exactly the sender's bytes,
at exactly the row where the bf16 dispatch of the same routing puts that token's row (duplicates of R > 1
included), padding rows zero with zero scales; route weights, `cu_seqlens` and the plan are the bf16
dispatch's. No tolerance anywhere: the rows are random bytes (NaN and infinity encodings included, which
must arrive untouched) and the scales random fp32 over 200 binades up to fp32's largest.

Where each token's row lands comes from the bf16 dispatch of tag rows (`[rank + 1, token, 0, ...]`, exact
in bf16) through the same plan (`dispatch(tags, plan=plan)`, the backward path, which must keep working
after an FP8 forward), which must equal a fresh bf16 forward dispatch of the same routing. Checked in the
threads world (torch reference; Triton row kernels, interpreted on the CPU, compiled on a GPU), the
collective world (gloo processes), the symmetric world's own code over a CPU stand-in for symmetric memory
and, on a GPU, the real symmetric-memory world (2 processes sharing it, both exchanges).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from test_buffer import Case
from test_collective import spawn
from test_comm_kernels import KERNEL_DEVICE

from moonep_moe.comm.buffer import Buffer
from moonep_moe.engine.communicator import MoECommunicator
from moonep_moe.fp8.format import FP8_DTYPE, dequantise_rows, quantise_rows, to_deep_gemm_row_scales
from moonep_moe.fp8.wire import pack_rows, packed_width, scale_columns, unpack_rows
from moonep_moe.transport.threads import run_ranks, single_world

BF16 = torch.bfloat16
U8 = torch.uint8


def fp8_rows(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [s, H] e4m3 of random bytes, scales [s, C] fp32)`: scales of random significands over
    2^-100..2^100, with fp32's largest finite value in the first token's last scale."""
    s, gen = case.num_tokens(rank), torch.Generator().manual_seed(77 + rank)
    q_sh = torch.randint(0, 256, (s, case.H), generator=gen, dtype=U8).view(FP8_DTYPE)
    columns = scale_columns(case.H)
    scales_sh = (torch.rand(s, columns, generator=gen) + 0.5) * torch.exp2(
        torch.randint(-100, 101, (s, columns), generator=gen).float())
    if s:
        scales_sh[0, -1] = torch.finfo(torch.float32).max
    return q_sh, scales_sh


def tag_rows(case: Case, rank: int) -> torch.Tensor:
    """`[s, H]` bf16: token t of rank r is `[r + 1, t, 0, ...]` (exact in bf16 for t <= 256)."""
    s = case.num_tokens(rank)
    tags_sh = torch.zeros(s, case.H, dtype=BF16)
    tags_sh[:, 0], tags_sh[:, 1] = rank + 1, torch.arange(s)
    return tags_sh


def fp8_job(world, case: Case, kernels: bool | None = None, zero_copy: bool = False,
            mn_major_scales: bool = False) -> dict:
    """One rank: an FP8 forward dispatch, a combine after it, the bf16 tags and the FP8 rows again through its
    plan, then a fresh bf16 forward dispatch of the tags; returns what landed (FP8 rows as bytes)."""
    device, rank = world.device, world.rank
    x = {k: v.to(device) for k, v in case.inputs(rank).items()}
    weights_sk = x["weights"].float()
    q_sh, scales_sh = (t.to(device) for t in fp8_rows(case, rank))
    given_scales = to_deep_gemm_row_scales(scales_sh) if mn_major_scales else scales_sh
    tags_sh = tag_rows(case, rank).to(device)
    buf = Buffer(case.S, case.H, case.K, case.E, case.R, token_padding=case.tp, world=world, dtype=BF16,
                 kernels=kernels)
    (q_nvsh, scales_nvsh), weights_nvs, cu_seqlens, plan = buf.dispatch(
        q_sh, weights_sk, x["topk"], x["tpe"], zero_copy=zero_copy, scales=given_scales)
    out = dict(q_sh=q_sh.view(U8).cpu(), scales_sh=scales_sh.cpu(), valid_sk=(x["topk"] >= 0).cpu(),
               q_nvsh=q_nvsh.view(U8).cpu().clone(), scales_nvsh=scales_nvsh.cpu().clone(),
               weights_nvs=weights_nvs.cpu(), cu=cu_seqlens.cpu(), dst=plan.dst.cpu().clone(),
               dups=plan.dup_counts.cpu().clone(),
               views=q_nvsh.data_ptr() == buf.hidden_nvsh_buffer_view.data_ptr())
    ones_nvsh = torch.ones(buf.NvS, case.H, dtype=BF16, device=device)
    out["routes_sh"] = buf.combine(plan, ones_nvsh)[0].cpu()  # combine stays bf16, over the FP8 rows' memory
    out["tags_nvsh"] = buf.dispatch(tags_sh, None, None, None, plan=plan)[0].cpu()
    again_nvsh, again_scales_nvsh = buf.dispatch(q_sh, None, None, None, plan=plan, scales=scales_sh)[0]
    out.update(again_nvsh=again_nvsh.view(U8).cpu(), again_scales_nvsh=again_scales_nvsh.cpu())
    tags_nvsh, weights2_nvs, cu2, plan2 = buf.dispatch(tags_sh, weights_sk, x["topk"], x["tpe"])
    out.update(fresh_tags_nvsh=tags_nvsh.cpu(), fresh_weights_nvs=weights2_nvs.cpu(), fresh_cu=cu2.cpu(),
               fresh_dst=plan2.dst.cpu())
    return out


def assert_fp8_rows_land_where_bf16_rows_land(case: Case, results: list[dict], zero_copy: bool = False
                                              ) -> dict[str, int]:
    """Every received FP8 row and its scales are the sending token's exactly, at the row of its bf16 tag;
    padding rows are zero; the rest is the bf16 dispatch's. Returns what was covered."""
    seen = dict(rows=0, padding=0, duplicates=0)
    for res in results:
        assert res["views"] == zero_copy, "views with zero_copy, copies without"
        nvs = res["tags_nvsh"].shape[0]
        assert res["q_nvsh"].shape == (nvs, case.H)
        assert res["scales_nvsh"].shape == (nvs, scale_columns(case.H))
        for key in ("cu", "dst", "weights_nvs"):  # the plan, its segments and the weights are bf16's
            assert torch.equal(res[key], res[f"fresh_{key}"]), key
        end = int(res["cu"][-1])
        assert torch.equal(res["tags_nvsh"][:end], res["fresh_tags_nvsh"][:end]), "backward dispatch, as bf16"
        assert torch.equal(res["again_nvsh"][:end], res["q_nvsh"][:end]), "FP8 through a plan, as forward"
        assert torch.equal(res["again_scales_nvsh"][:end], res["scales_nvsh"][:end])
        assert torch.equal(res["routes_sh"], res["valid_sk"].sum(1, keepdim=True).to(BF16).expand(-1, case.H))
        seen["duplicates"] += int(res["dups"][1])
        for v, tag in enumerate(res["tags_nvsh"][:end].tolist()):
            sender, token = int(tag[0]) - 1, int(tag[1])
            if sender < 0:  # padding
                assert not res["q_nvsh"][v].any() and not res["scales_nvsh"][v].any(), v
                seen["padding"] += 1
                continue
            source = results[sender]
            assert torch.equal(res["q_nvsh"][v], source["q_sh"][token]), (v, sender, token)
            assert torch.equal(res["scales_nvsh"][v], source["scales_sh"][token]), (v, sender, token)
            seen["rows"] += 1
    routes = sum(int(res["valid_sk"].sum()) for res in results)
    assert seen["rows"] == routes, "every valid route's row arrived"
    return seen


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_fp8_rows_land_where_bf16_rows_land(R, kind):
    case = Case(R=R, S=16, H=200, K=3, E=8 if R < 4 else 16, tp=4, kind=kind, seed=R)
    seen = assert_fp8_rows_land_where_bf16_rows_land(case, run_ranks(functools.partial(
        fp8_job, case=case, kernels=False), R))
    assert seen["padding"] and (R == 1 or seen["duplicates"]), seen


@pytest.mark.parametrize("zero_copy", [False, True])
def test_fp8_zero_copy_views_and_mn_major_scales(zero_copy):
    """Views of the packed rows with `zero_copy`; scales given in DeepGEMM's MN-major layout move alike."""
    case = Case(R=2, S=16, H=136, K=4, E=8, tp=4, kind="skewed", invalid=0.1)
    job = functools.partial(fp8_job, case=case, zero_copy=zero_copy, mn_major_scales=True)
    assert_fp8_rows_land_where_bf16_rows_land(case, run_ranks(job, 2), zero_copy)


@pytest.mark.parametrize("tokens", [(0, 5, 16, 1), (0, 0, 0, 0)], ids=["some-empty", "all-empty"])
def test_fp8_empty_and_fewer_tokens(tokens):
    case = Case(R=4, S=16, H=128, K=2, E=8, tp=4, tokens=tokens)
    assert_fp8_rows_land_where_bf16_rows_land(case, run_ranks(functools.partial(fp8_job, case=case), 4))


def test_fp8_deepseek_v3_wide_rows():
    """H = 7168 (56 scales, 7392-byte packed rows), the smallest H that fits bf16's bytes (8: 16 bytes), and
    an H with a tail tile and padding bytes (100: 4 + 100 + 12 padding)."""
    for H in (7168, 8, 100):
        case = Case(R=2, S=8, H=H, K=4, E=8, tp=4, kind="skewed", invalid=0.1)
        assert_fp8_rows_land_where_bf16_rows_land(case, run_ranks(functools.partial(fp8_job, case=case), 2))
    assert packed_width(7168) == 7392 and packed_width(8) == 16 and packed_width(100) == 112
    fits = [H for H in range(1, 20_000) if packed_width(H) <= 2 * H]
    assert fits[:6] == [8, 9, 10, 11, 12, 16] and fits[5:] == list(range(16, 20_000)), "bf16: H >= 16 fits"


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
@pytest.mark.parametrize("hidden", [7168, 100, 10, 9])
def test_a_copying_fp8_dispatch_copies_the_rows_the_plan_fills_into_contiguous_tensors(hidden, kernels):
    """What a dispatch without `zero_copy` returns: each exchange's `filled_copy` of the packed rows' e4m3
    bytes and scales (views of row stride `packed_width(H)`; copied as 8-, 4-, 2- and 1-byte words for
    these H), as contiguous tensors of their own, equal to the views up to the plan's end."""
    from moonep_moe.comm.exchange import KernelExchange, ReferenceExchange, as_words
    from moonep_moe.comm.kernels import experts, rows

    capacity, end, gen = 12, 7, torch.Generator().manual_seed(hidden)
    q_sh = torch.randint(0, 256, (capacity, hidden), dtype=U8, generator=gen)
    scales_sh = torch.rand(capacity, scale_columns(hidden), generator=gen)
    packed_nvsh = pack_rows(q_sh.view(FP8_DTYPE), scales_sh).to(KERNEL_DEVICE)
    plan = SimpleNamespace(cu_seqlens=torch.tensor([0, 3, end], dtype=torch.int32, device=KERNEL_DEVICE))
    exchange = (KernelExchange(SimpleNamespace(num_sms=None), rows, experts) if kernels
                else ReferenceExchange(SimpleNamespace()))
    views = unpack_rows(packed_nvsh, hidden)
    assert views[0].stride(0) == packed_width(hidden) and not views[0].is_contiguous()
    words = {view.dtype: as_words(view)[0].dtype.itemsize for view in views}
    assert words[torch.float32] >= 4 and words[FP8_DTYPE] == max(w for w in (8, 4, 2, 1) if hidden % w == 0)
    q_copy, scales_copy = (exchange.filled_copy(view, plan).cpu() for view in views)
    assert q_copy.dtype == FP8_DTYPE and q_copy.is_contiguous() and scales_copy.is_contiguous()
    assert q_copy.shape == (capacity, hidden) and scales_copy.shape == scales_sh.shape
    assert torch.equal(q_copy[:end].view(U8), q_sh[:end]) and torch.equal(scales_copy[:end], scales_sh[:end])
    assert torch.equal(views[0].cpu().view(U8), q_sh) and torch.equal(views[1].cpu(), scales_sh)
    if not kernels:  # the fixed-shape reference copies every row
        assert torch.equal(q_copy.view(U8), q_sh) and torch.equal(scales_copy, scales_sh)


@pytest.mark.parametrize(("hidden", "end"), [(7168, 6), (100, 6), (9, 6), (100, 0), (100, 10)])
def test_copy_rows_between_row_strided_views_writes_only_their_rows_up_to_the_end(hidden, end):
    """The row kernel behind the copies, from and into views of packed rows: row strides `packed_width`
    (source and target), rows up to the end read on the device (none, some, all); every other byte of the
    target's memory (rows past the end, the scales and padding between its rows) keeps its sentinel."""
    from moonep_moe.comm.exchange import as_words
    from moonep_moe.comm.kernels import rows

    capacity, gen = 10, torch.Generator().manual_seed(hidden)
    source_nvsh = torch.randint(0, 256, (capacity, packed_width(hidden)), dtype=U8, generator=gen)
    target_nvsh = torch.full_like(source_nvsh, 0x7F).to(KERNEL_DEVICE)
    end_1 = torch.tensor([end], dtype=torch.int32, device=KERNEL_DEVICE)
    targets, sources = (unpack_rows(t.to(KERNEL_DEVICE), hidden) for t in (target_nvsh, source_nvsh))
    for got, given in zip(targets, sources, strict=True):
        rows.copy_rows(*as_words(got, given), end_1)
    want_nvsh = torch.full_like(source_nvsh, 0x7F)
    scales_start = -(-hidden // 4) * 4
    for columns in (slice(0, hidden), slice(scales_start, scales_start + 4 * scale_columns(hidden))):
        want_nvsh[:end, columns] = source_nvsh[:end, columns]
    assert torch.equal(target_nvsh.cpu(), want_nvsh)


@pytest.mark.parametrize("R", [1, 2])
def test_fp8_dispatch_through_the_row_kernels(R):
    """The Triton row kernels (interpreted on the CPU, compiled on a GPU) move the packed rows."""
    case = Case(R=R, S=16, H=200, K=3, E=8, tp=4, kind="skewed", invalid=0.1)
    for zero_copy in (False, True):
        results = run_ranks(functools.partial(fp8_job, case=case, kernels=True, zero_copy=zero_copy), R,
                            device=KERNEL_DEVICE)
        assert_fp8_rows_land_where_bf16_rows_land(case, results, zero_copy)


def test_fp8_dispatch_in_the_collective_world(tmp_path):
    case = Case(R=2, S=16, H=200, K=3, E=8, tp=4, kind="skewed", invalid=0.1)
    assert_fp8_rows_land_where_bf16_rows_land(case, spawn(functools.partial(fp8_job, case=case), 2, tmp_path))


def test_fp8_dispatch_in_the_symmetric_worlds_code_on_a_cpu_stand_in(monkeypatch):
    """The symmetric world's own scatter_rows (its dump-row targets seen as packed rows), on the CPU."""
    from test_symmetric import run_stand_in

    case = Case(R=2, S=16, H=200, K=3, E=8, tp=4, kind="skewed", invalid=0.1)
    results = run_stand_in(functools.partial(fp8_job, case=case), 2, monkeypatch)
    assert_fp8_rows_land_where_bf16_rows_land(case, results)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [True, False])
def test_fp8_dispatch_in_the_symmetric_world(tmp_path, kernels):
    from test_symmetric import spawn_symmetric

    case = Case(R=2, S=16, H=200, K=3, E=8, tp=4, kind="skewed", invalid=0.1)
    results = spawn_symmetric(functools.partial(fp8_job, case=case, kernels=kernels), 2, tmp_path)
    assert_fp8_rows_land_where_bf16_rows_land(case, results)


# -- errors, before anything moves --------------------------------------------------------------------------


def one_rank(H: int = 200, dtype: torch.dtype = BF16):
    case = Case(R=1, S=16, H=H, K=2, E=8, tp=4, invalid=0.0)
    buf = Buffer(case.S, case.H, case.K, case.E, 1, token_padding=case.tp, world=single_world(), dtype=dtype)
    x = case.inputs(0)
    q_sh, scales_sh = fp8_rows(case, 0)
    return buf, x, q_sh, scales_sh


@pytest.mark.parametrize(("make", "message"), [
    (lambda x, q, s: (q, None),
     r"rank 0: hidden_sh is torch.float8_e4m3fn: FP8 rows travel with their 1x128 scales, pass them as "
     r"scales \(float32 \[s, 2\]\)"),
    (lambda x, q, s: (x["hidden"].to(BF16), s),
     r"rank 0: scales is only for FP8 \(torch.float8_e4m3fn\) hidden_sh, got hidden_sh in torch.bfloat16"),
    (lambda x, q, s: (q, s[:, :1]), r"rank 0: scales must have shape \[16, 2\], got \[16, 1\]"),
    (lambda x, q, s: (q, s.double()), r"rank 0: scales must have dtype torch.float32, got torch.float64"),
    (lambda x, q, s: (q[:, :100], s), r"rank 0: hidden_sh must have shape \[16, 200\], got \[16, 100\]"),
    (lambda x, q, s: (q, s.numpy()), r"rank 0: scales must be a torch.Tensor, got ndarray"),
])
def test_dispatch_scales_errors_name_the_argument_and_rank(make, message):
    buf, x, q_sh, scales_sh = one_rank()
    hidden, scales = make(x, q_sh, scales_sh)
    with pytest.raises((ValueError, TypeError), match=message):
        buf.dispatch(hidden, x["weights"].float(), x["topk"], x["tpe"], scales=scales)
    assert not buf.hidden_nvsh_buffer_view.any(), "nothing moved"


def test_fp8_rows_that_do_not_fit_the_buffers_rows_raise():
    """H = 7: 16 packed bytes, more than a bf16 row's 14 (a float32 Buffer's 28 hold them)."""
    buf, x, q_sh, scales_sh = one_rank(H=7)
    with pytest.raises(ValueError, match=r"rank 0: scales: FP8 rows of H=7 with their scales take 16 bytes, "
                                         r"more than this Buffer's torch.bfloat16 rows \(14 bytes\) hold"):
        buf.dispatch(q_sh, x["weights"].float(), x["topk"], x["tpe"], scales=scales_sh)
    buf, x, q_sh, scales_sh = one_rank(H=7, dtype=torch.float32)
    (q_nvsh, _), *_ = buf.dispatch(q_sh, x["weights"].float(), x["topk"], x["tpe"], scales=scales_sh)
    assert q_nvsh.dtype == FP8_DTYPE


# -- the engine facade: MoECommunicator(quantization="fp8_e4m3") --------------------------------------------


def communicator_job(world, case: Case) -> dict:
    """One rank, vLLM's order: quantise the bf16 rows, dispatch e4m3 rows with their scales (eagerly, then
    as a request), run "experts" on the dequantised rows, combine in bf16; beside it the bf16 communicator
    on the same routing, whose experts see the same dequantised rows."""
    x = case.inputs(world.rank)
    gen = torch.Generator().manual_seed(5 + world.rank)
    hidden_th = (torch.randn(case.num_tokens(world.rank), case.H, generator=gen) * 100).to(BF16)
    q_th, scales_th = quantise_rows(hidden_th)
    fields = dict(world=world, hidden_size=case.H, num_experts=case.E, top_k=case.K,
                  max_tokens_per_rank=case.S, token_padding=case.tp, dtype="bfloat16")
    fp8, bf16 = MoECommunicator(quantization="fp8_e4m3", **fields), MoECommunicator(**fields)
    out = {}
    for step in ("eager", "request"):
        weights_tk = x["weights"].float()
        if step == "eager":
            got, handle = fp8.dispatch(q_th, x["topk"], weights_tk, scales=scales_th)
        else:
            got, handle = fp8.dispatch_async(q_th, x["topk"], weights_tk, scales=to_deep_gemm_row_scales(
                scales_th)).wait()
        want, want_handle = bf16.dispatch(hidden_th, x["topk"], weights_tk)
        end = int(got.offsets_g[-1])
        rows_nvsh = dequantise_rows(got.tokens_nvsh.view(U8)[:end].view(FP8_DTYPE), got.scales_nvsh[:end])
        y_nvsh = torch.zeros(got.tokens_nvsh.shape[0], case.H, dtype=BF16)
        y_nvsh[:end] = (rows_nvsh * got.weights_nvs[:end, None]).to(BF16)
        want_q, want_scales = quantise_rows(want.tokens_nvsh[:end])
        padding_v = ~want.tokens_nvsh[:end].any(1)  # the bf16 rows are nonzero: randn * 100
        out[step] = dict(
            q=torch.equal(got.tokens_nvsh[:end][~padding_v].view(U8), want_q[~padding_v].view(U8)),
            scales=torch.equal(got.scales_nvsh[:end][~padding_v], want_scales[~padding_v]),
            padding=int(padding_v.sum()),
            padding_zero=not got.tokens_nvsh[:end][padding_v].view(U8).any()
            and not got.scales_nvsh[:end][padding_v].any(),
            groups=all(torch.equal(getattr(got, f), getattr(want, f)) for f in
                       ("weights_nvs", "num_tokens_per_expert_g", "offsets_g", "expert_ids_g")),
            bf16_scales=want.scales_nvsh is None,
            combined=torch.equal(fp8.combine(y_nvsh, handle), bf16.combine(y_nvsh, want_handle)))
    return out


def test_communicator_dispatches_fp8_rows_with_their_scales():
    case = Case(R=2, S=16, H=200, K=3, E=8, tp=4, kind="skewed", invalid=0.1, tokens=(5, 16))
    for res in run_ranks(functools.partial(communicator_job, case=case), 2):
        for step, checks in res.items():
            assert checks.pop("padding") > 0, step
            assert all(checks.values()), (step, checks)


def test_communicator_quantisation_errors():
    case = Case(R=1, S=16, H=200, K=2, E=8, tp=4)
    x = case.inputs(0)
    q_sh, scales_sh = fp8_rows(case, 0)
    comm = MoECommunicator(world=single_world(), hidden_size=case.H, num_experts=case.E, top_k=case.K,
                           max_tokens_per_rank=case.S, dtype="bfloat16", quantization="fp8_e4m3")
    with pytest.raises(ValueError, match=r"rank 0: quantization='fp8_e4m3': input_th must be "
                                         r"torch.float8_e4m3fn rows with their scales=, got torch.bfloat16"):
        comm.dispatch(x["hidden"].to(BF16), x["topk"], scales=scales_sh)
    with pytest.raises(ValueError, match=r"rank 0: input_th is torch.float8_e4m3fn: FP8 rows travel with "
                                         r"their 1x128 scales, pass them as scales"):
        comm.dispatch(q_sh, x["topk"])
    with pytest.raises(ValueError, match=r"rank 0: scales must have shape \[16, 2\], got \[16, 1\]"):
        comm.dispatch(q_sh, x["topk"], scales=scales_sh[:, :1])
    none = MoECommunicator(world=single_world(), hidden_size=case.H, num_experts=case.E, top_k=case.K,
                           max_tokens_per_rank=case.S, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"rank 0: quantised dispatch \(torch.bfloat16 with scales\) needs "
                                         r"quantization='fp8_e4m3', this communicator's is 'none'"):
        none.dispatch(x["hidden"].to(BF16), x["topk"], scales=scales_sh)
