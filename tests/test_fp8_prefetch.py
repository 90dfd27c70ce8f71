"""FP8 weights on the wire (prefetch): `Buffer.prefetch_weight(..., scales=)`,
`ExpertLayout.from_fused(..., scales=)` and `MoECommunicator.prefetch_weights` move FP8 experts (e4m3 bytes
with one fp32 scale per 128x128 block) into the slots, half the bytes of bf16.

The contract: moving the FP8 weights equals moving the bf16 weights and quantising the slots after, bit for
bit (quantisation is per block, and a block never straddles two experts). Checked on skewed routing (so
slots are used) with shapes that have tail blocks, in both weight forms (`ExpertRows` and the replicated
`[E+B, N, K]`), in the threads world (the torch reference; the Triton copy kernel, interpreted on the CPU,
compiled on a GPU), the collective world (2 gloo processes) and, on a GPU, the symmetric-memory world (2
processes sharing it).
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_buffer import Case, dispatch
from test_collective import spawn
from test_comm_kernels import KERNEL_DEVICE

from moonep_moe.engine.communicator import MoECommunicator
from moonep_moe.engine.layout import ExpertLayout
from moonep_moe.fp8.format import FP8_DTYPE, block_scales_shape, quantise_blocks
from moonep_moe.transport.threads import run_ranks, single_world
from moonep_moe.weights.pool import ExpertRows

CASE = dict(S=16, H=8, K=2, E=8, tp=4, kind="skewed", invalid=0.0)
SHAPES_NK = ((160, 136), (136, 160))
"""gate_up-like and down-like experts, each with tail blocks (160 = 128 + 32, 136 = 128 + 8)."""
JUNK = 7.0
"""What every slot (and slot scale) holds before the prefetch: exact in bf16 and e4m3."""


def experts(E: int) -> list[torch.Tensor]:
    """The group's bf16 experts `[E, N, K]` per projection, the same on every rank (values over 12 binades,
    so blocks mix normal and subnormal e4m3)."""
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(E, *nk, generator=gen) * torch.exp2(torch.randint(-8, 4, (E, *nk), generator=gen)))
            .bfloat16() for nk in SHAPES_NK]


def prefetch_job(world, form: str = "expert_rows", kernels: bool | None = None) -> dict:
    """One rank: the same plan's prefetch of the bf16 experts and of their FP8 copies with scales (slots
    first filled with junk); returns this rank's slots of each (FP8 as uint8 bytes) and its slot table."""
    case = Case(R=world.size, **CASE)
    device, r, epn = world.device, world.rank, case.epn
    buf = case.buffer(world, kernels=kernels)
    _, _, _, plan = dispatch(buf, {k: v.to(device) for k, v in case.inputs(r).items()})
    out = {"experts_to_copy": plan.experts_to_copy[r].cpu()}
    bf16 = [w.to(device) for w in experts(case.E)]
    fp8 = [quantise_blocks(w) for w in bf16]
    B = buf.B
    given = {"bf16": ([(w, None) for w in bf16]), "fp8": fp8}
    for kind, parts in given.items():
        weights, scales = [], []
        for p, (w, s) in enumerate(parts):
            junk = torch.full((B, *w.shape[1:]), JUNK, device=device).to(w.dtype)
            if form == "replicated":
                weights.append(torch.cat([w, junk]))
                scales.append(None if s is None else torch.cat([s, torch.full((B, *s.shape[1:]), JUNK,
                                                                              device=device)]))
                continue
            weights.append(ExpertRows(world.symmetric(f"{kind}{p}/home", w[r * epn:(r + 1) * epn].clone()),
                                      world.symmetric(f"{kind}{p}/slots", junk)))
            scales.append(None if s is None else ExpertRows(
                world.symmetric(f"{kind}{p}/home_scales", s[r * epn:(r + 1) * epn].clone()),
                world.symmetric(f"{kind}{p}/slot_scales",
                                torch.full((B, *s.shape[1:]), JUNK, device=device))))
        buf.prefetch_weight(plan, weights[0], None, weights[1], None if kind == "bf16" else
                            (scales[0], None, scales[1]))
        for p, (w, s) in enumerate(zip(weights, scales, strict=True)):
            slots = w[case.E:] if form == "replicated" else w.slots.local
            out[f"{kind}{p}"] = (slots.view(torch.uint8) if kind == "fp8" else slots).cpu().clone()
            if s is not None:
                out[f"scales{p}"] = (s[case.E:] if form == "replicated" else s.slots.local).cpu().clone()
    return out


def assert_fp8_slots_are_the_quantised_bf16_slots(results: list[dict], before: float = JUNK) -> None:
    """Used slots hold the moved experts, FP8 ones the quantised bf16 ones; unused slots still hold `before`,
    what every slot held before the prefetch."""
    used = 0
    for res in results:
        for p in range(len(SHAPES_NK)):
            want_q, want_s = quantise_blocks(res[f"bf16{p}"])
            assert res[f"fp8{p}"].nbytes * 2 == res[f"bf16{p}"].nbytes, "half the bytes of bf16"
            for j, expert in enumerate(res["experts_to_copy"].tolist()):
                if expert >= 0:
                    used += 1
                    assert torch.equal(res[f"fp8{p}"][j], want_q[j].view(torch.uint8)), (p, j, expert)
                    assert torch.equal(res[f"scales{p}"][j], want_s[j]), (p, j, expert)
                else:  # unused slots are not written (their segments are empty)
                    assert (res[f"bf16{p}"][j] == before).all(), (p, j)
                    assert torch.equal(res[f"fp8{p}"][j], torch.full_like(res[f"bf16{p}"][j], before).to(
                        FP8_DTYPE).view(torch.uint8)), (p, j)
                    assert (res[f"scales{p}"][j] == before).all(), (p, j)
    assert used, "skewed routing must use slots"


@pytest.mark.parametrize("form", ["expert_rows", "replicated"])
@pytest.mark.parametrize("R", [2, 4])
def test_fp8_prefetch_equals_quantising_the_moved_bf16_weights(R, form):
    results = run_ranks(functools.partial(prefetch_job, form=form, kernels=False), R)
    assert_fp8_slots_are_the_quantised_bf16_slots(results)


def test_fp8_prefetch_through_the_copy_kernel():
    """The Triton copy kernel (interpreted on the CPU, compiled on a GPU) moves the bytes and scales."""
    results = run_ranks(functools.partial(prefetch_job, kernels=True), 2, device=KERNEL_DEVICE)
    assert_fp8_slots_are_the_quantised_bf16_slots(results)


@pytest.mark.parametrize("form", ["expert_rows", "replicated"])
def test_fp8_prefetch_in_the_collective_world(tmp_path, form):
    assert_fp8_slots_are_the_quantised_bf16_slots(spawn(functools.partial(prefetch_job, form=form), 2,
                                                        tmp_path))


@pytest.mark.gpu
def test_fp8_prefetch_in_the_symmetric_world(tmp_path):
    from test_symmetric import spawn_symmetric

    assert_fp8_slots_are_the_quantised_bf16_slots(spawn_symmetric(prefetch_job, 2, tmp_path))


# -- the engine facade: ExpertLayout and MoECommunicator ---------------------------------------------------


def test_communicator_prefetches_an_fp8_layout_with_its_scales():
    case = Case(R=2, **CASE)
    w13, w2 = experts(case.E)  # [E, 160, 136] as w13 [E, 2I, H] with I = 80, H = 136; w2 [E, 136, 160]
    w2 = w2[:, :, :80].contiguous()
    (q13, s13), (q2, s2) = quantise_blocks(w13), quantise_blocks(w2)

    def fn(world):
        comm = MoECommunicator(world=world, hidden_size=case.H, num_experts=case.E, top_k=case.K,
                               max_tokens_per_rank=case.S, token_padding=case.tp, dtype="float64")
        fp8 = ExpertLayout.from_fused(world, q13, q2, num_slots=comm.num_slots, name="fp8", scales=(s13, s2))
        bf16 = ExpertLayout.from_fused(world, w13, w2, num_slots=comm.num_slots, name="bf16")
        x = case.inputs(world.rank)
        _, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"])
        comm.prefetch_weights(handle, fp8)
        comm.prefetch_weights(handle, bf16)
        assert fp8.gate_up.home.local.dtype == FP8_DTYPE and fp8.scales[1] is None
        scales_bytes = sum(s.home.local.nbytes + s.slots.local.nbytes for s in (fp8.scales[0], fp8.scales[2]))
        assert bf16.scales is None and fp8.nbytes == bf16.nbytes // 2 + scales_bytes
        return {"experts_to_copy": handle._plan.experts_to_copy[world.rank],
                "bf160": bf16.gate_up.slots.local.clone(), "bf161": bf16.down.slots.local.clone(),
                "fp80": fp8.gate_up.slots.local.view(torch.uint8).clone(),
                "fp81": fp8.down.slots.local.view(torch.uint8).clone(),
                "scales0": fp8.gate_up_scales.slots.local.clone(),
                "scales1": fp8.down_scales.slots.local.clone()}

    assert_fp8_slots_are_the_quantised_bf16_slots(run_ranks(fn, 2), before=0.0)  # new slot pools are zero


# -- errors, before anything moves --------------------------------------------------------------------------


def one_rank_buffer():
    case = Case(R=1, **{**CASE, "kind": "uniform"})
    world = single_world()
    buf = case.buffer(world)
    _, _, _, plan = dispatch(buf, case.inputs(0))
    return buf, plan


@pytest.mark.parametrize(("make", "message"), [
    (lambda q, s, w: ((q, None, None), None),
     r"rank 0: full_gate_weight is torch.float8_e4m3fn: FP8 weights move with their 128x128 block scales, "
     r"pass them as scales\[0\]"),
    (lambda q, s, w: ((w, None, None), (s, None, None)),
     r"rank 0: full_gate_weight is torch.bfloat16: scales\[0\] is only for FP8 \(torch.float8_e4m3fn\) "
     r"weights, pass None"),
    (lambda q, s, w: ((q, None, None), (s, s, None)),
     r"rank 0: scales\[1\] is given but full_up_weight is None"),
    (lambda q, s, w: ((q, None, None), (s[:, :1], None, None)),
     r"rank 0: scales\[0\] must have shape \[8, 2, 2\], got \[8, 1, 2\]"),
    (lambda q, s, w: ((q, None, None), (s.double(), None, None)),
     r"rank 0: scales\[0\] must have dtype torch.float32, got torch.float64"),
    (lambda q, s, w: ((q, None, None), [s]),
     r"rank 0: scales must be None or a tuple \(gate_scales, up_scales"),
])
def test_prefetch_weight_scales_errors_name_the_argument_and_rank(make, message):
    buf, plan = one_rank_buffer()
    w = experts(8)[0]
    q, s = quantise_blocks(w)
    (gate, up, down), scales = make(q, s, w)
    before = q.clone()
    with pytest.raises(ValueError, match=message):
        buf.prefetch_weight(plan, gate, up, down, scales)
    assert torch.equal(q.view(torch.uint8), before.view(torch.uint8)), "nothing moved"


def test_prefetch_weight_scales_must_take_the_weights_form():
    buf, plan = one_rank_buffer()
    world = buf.world
    q, s = quantise_blocks(experts(8)[0])
    rows = ExpertRows(world.symmetric("q/home", q.clone()), world.symmetric("q/slots", q[:0].clone()))
    with pytest.raises(ValueError, match=r"rank 0: scales\[0\] must be in full_gate_weight's form "
                                         r"\(ExpertRows\), got Tensor"):
        buf.prefetch_weight(plan, rows, None, None, (s, None, None))


def test_layout_scales_errors():
    world = single_world()
    w13, w2 = experts(8)
    (q13, s13), (q2, s2) = quantise_blocks(w13), quantise_blocks(w2)
    with pytest.raises(ValueError, match=r"scales are for FP8 \(torch.float8_e4m3fn\) experts kept FP8, "
                                         r"got w13 torch.bfloat16"):
        ExpertLayout.from_fused(world, w13, w2[:, :, :80], num_slots=0, name="a", scales=(s13, s2))
    with pytest.raises(ValueError, match=r"scales: w2_scales must be float32 \[8, 2, 1\] \(one per 128x128 "
                                         r"block\), got torch.float32 \[8, 2, 2\]"):
        ExpertLayout.from_fused(world, q13, q2[:, :, :80], num_slots=0, name="b", scales=(s13, s2))
    assert block_scales_shape(q13.shape) == tuple(s13.shape) == (8, 2, 2)
