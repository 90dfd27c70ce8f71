"""Prefetch beside the home experts' first GEMM (`MoEConfig.overlap_prefetch`, `gemm.base.SlotsReady`): the
replicas' weights arrive on the comm stream while gate_up's forward GEMM (and down's dgrad in backward) runs
over the home experts' groups; a device-side wait, then the slot groups.

On one GPU, one EP rank whose slots a plan fills (`bench.ep_rank.as_ep_rank`: its prefetch stands in local
copies of the same bytes, on the Buffer's comm stream as the real one runs). The comm stream is held back
(`torch.cuda._sleep`) and the slots are NaN before each prefetch, so a GEMM that read a slot before its
weights arrived would show. Checked: output and every gradient bit-identical to the same layer prefetching on
the caller's stream before the same split GEMM (and within bf16's rounding of the layer without overlap,
whose one GEMM computes the slot groups with another kernel), and a profiler trace in which the home
experts' GEMM runs while the copies are still to come and the slot groups' GEMM after them. Both backends
that split the GEMM: torch._grouped_mm and DeepGEMM on the home groups. The trace
(`prefetch-overlap-{gemm}-tp{padding}-{phase}.json`) is written under `$MOONEP_BENCH_OUT` when set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

pytestmark = pytest.mark.gpu

EPN, TOKENS, HIDDEN, FFN, TOP_K = 4, 2048, 2048, 1024, 4
DELAY_CYCLES = 200_000_000  # ~100 ms at the H200's clock: far longer than the rank's GEMMs here, and than a
# time slice of other processes on the GPU (the suite runs six side by side), which the sleep runs through


GEMMS = (("torch", 16), ("torch", 128), ("deep_gemm", 128))
"""The backends that split the first GEMM, each with a token_padding: torch._grouped_mm or DeepGEMM on the
home groups, the Triton `groups_from` GEMM on the slot groups (its aligned kernel on 128-row segments)."""
GEMM_IDS = [f"{gemm}-tp{padding}" for gemm, padding in GEMMS]


def skip_without(gemm: str) -> None:
    if gemm == "deep_gemm":
        from moonep_moe.gemm.deep_gemm import unsupported_reason

        reason = unsupported_reason(torch.device("cuda"), torch.bfloat16, HIDDEN, 128)
        if reason is not None:
            pytest.skip(reason)


def rank_layer(overlap: bool, prefetch_async: bool = True, gemm: str = "torch", padding: int = 16
               ) -> MoonEPMoELayer:
    """One EP rank (`as_ep_rank`, a plan filling two slots) on the `gemm` backend, segments padded to
    `padding` rows; with `overlap` and not `prefetch_async` the prefetch runs on the caller's stream before
    the split GEMM, which then has nothing to wait for."""
    from bench.ep_rank import RankPlan, as_ep_rank

    routes = TOKENS * TOP_K
    plan = RankPlan(ranks=2, rank=0, home_routes=(routes // 4, routes // 4, 0, routes // 8),
                    slot_routes=(0, routes // 4, 0, routes // 8), maxvio=1.0, sigma=0.1)
    cfg = MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=2 * EPN, top_k=TOP_K,
                    max_tokens_per_rank=TOKENS, dtype="bfloat16", grouped_gemm=gemm, token_padding=padding,
                    overlap_prefetch=overlap)
    torch.manual_seed(0)
    layer = as_ep_rank(MoonEPMoELayer(cfg, single_world("cuda")), EPN, plan)
    if not prefetch_async:
        buffer = layer._state.buffer
        prefetch = buffer.prefetch_weight
        buffer.prefetch_weight = lambda *args, async_finish=False, **kwargs: prefetch(*args, **kwargs)
    return layer


def stale_slots_and_late_comm(layer: MoonEPMoELayer) -> None:
    """Slots NaN (what a read before the prefetch's wait would see) and the comm stream busy for a while."""
    for rows in layer.experts.rows:
        rows.slots.local.fill_(float("nan"))
    with torch.cuda.stream(layer._state.buffer.inner._comm_stream()):
        torch.cuda._sleep(DELAY_CYCLES)


def step(layer: MoonEPMoELayer) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    stale_slots_and_late_comm(layer)
    out = layer(x)
    stale_slots_and_late_comm(layer)
    out.backward(grad)
    torch.cuda.synchronize()
    return [out, x.grad, layer.experts.gate_up.grad, layer.experts.down.grad]


@pytest.mark.parametrize(("gemm", "padding"), GEMMS, ids=GEMM_IDS)
def test_prefetch_beside_the_home_gemm_is_bit_identical_to_prefetch_before_it(gemm, padding):
    skip_without(gemm)
    results = {}
    for key in ((True, True), (True, False), (False, True)):
        layer = rank_layer(*key, gemm=gemm, padding=padding)
        results[key] = step(layer)
        layer.destroy()
    for name, overlapped, serial, plain in zip(("out", "grad_x", "grad_gate_up", "grad_down"),
                                               *results.values(), strict=True):
        assert torch.isfinite(serial).all(), name
        assert torch.equal(serial, overlapped), f"{name} differs with the prefetch beside the home GEMM"
        torch.testing.assert_close(plain, overlapped, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


def device_events(trace: dict) -> list[dict]:
    """Kernels and copies of a chrome trace: `name`, `stream`, `start`, `end` (us)."""
    return [dict(name=e["name"], stream=e["args"]["stream"], start=e["ts"], end=e["ts"] + e["dur"])
            for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]


HOME_KERNELS = {"torch": "cutlass", "deep_gemm": "deep_gemm"}
"""A name part of each backend's home-group GEMM kernels (torch._grouped_mm's are CUTLASS's)."""


@pytest.mark.parametrize(("gemm", "padding"), GEMMS, ids=GEMM_IDS)
def test_profiler_trace_shows_the_home_gemm_running_while_the_replicas_arrive(tmp_path, gemm, padding):
    """Forward and backward each, the comm stream held back from the start of the step: the first grouped
    GEMM, over the home experts (`torch._grouped_mm` or DeepGEMM), starts before the slots' copies on the
    comm stream end, and the slot groups' GEMM (`groups_from`, its aligned kernel on 128-row segments)
    starts after them."""
    skip_without(gemm)
    layer = rank_layer(overlap=True, gemm=gemm, padding=padding)
    step(layer)  # kernels built, pools allocated
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    out_dir = Path(os.environ.get("MOONEP_BENCH_OUT") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = None
    for phase in ("forward", "backward"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            stale_slots_and_late_comm(layer)
            if phase == "forward":
                out = layer(x)
            else:
                out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
        path = out_dir / f"prefetch-overlap-{gemm}-tp{padding}-{phase}.json"
        prof.export_chrome_trace(str(path))
        events = device_events(json.loads(path.read_text()))
        home = [e for e in events if HOME_KERNELS[gemm] in e["name"]]
        slots = [e for e in events if "groups_from" in e["name"]]
        # the stand-in prefetch's copies, the comm stream's first (backward's combine copies there too): a
        # copy per weight and used slot
        gemm_streams = {e["stream"] for e in slots}
        copies = sorted((e for e in events if "Memcpy" in e["name"] and e["stream"] not in gemm_streams),
                        key=lambda e: e["start"])[:2 * len(layer._state.buffer.used_j)]
        assert copies and home and slots, f"{phase}: copies, home GEMM or slot GEMM missing in {path}"
        aligned = {"aligned" in e["name"] for e in slots}
        assert aligned == {padding % 128 == 0}, f"{phase}: the slot groups' kernels {aligned} at tp {padding}"
        arrived = max(e["end"] for e in copies)
        first_home = min(home, key=lambda e: e["start"])
        assert first_home["start"] < arrived, f"{phase}: the home GEMM waited for the replicas ({path})"
        assert min(e["start"] for e in slots) >= arrived, f"{phase}: slot GEMM before the replicas ({path})"
        print(f"{phase}: the home GEMM started {arrived - first_home['start']:.0f} us before the replicas "
              "arrived")
    layer.destroy()
