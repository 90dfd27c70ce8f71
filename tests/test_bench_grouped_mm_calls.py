"""bench/grouped_mm_calls.py's recording, role labels and pairing, on the CPU (`torch._grouped_mm` runs bf16
there): the dispatch-mode recorder sees a step's forward and autograd's backward calls with the tensors
they read; and bench/common.py's alternated timer runs its arms in turns, each after its own untimed call."""

import pytest
import torch

from bench.common import alternated_timings, l2_flush
from bench.grouped_mm_calls import (
    ROLES,
    GroupedMMRecorder,
    call_role,
    grouped_kernel_ms,
    main,
    match_roles,
    profiled_call_ms,
    round_ratios,
    run_call,
    step_calls,
)
from bench.layer_step import step
from bench.native_layer import TorchNativeMoE
from moonep_moe import MoEConfig, MoonEPMoELayer
from moonep_moe.transport.threads import single_world

T, H, F, E, K = 16, 48, 16, 4, 2
"""A tiny layer whose projections' dims all differ (H, H' and 2H'), so every role has its own dims."""


def native_cpu(seed: int = 0) -> TorchNativeMoE:
    layer = TorchNativeMoE(H, F, E, K, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return layer


def tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_th = torch.randn(T, H, generator=gen).bfloat16().requires_grad_()
    return x_th, torch.randn(T, H, generator=gen).bfloat16()


def recorded(layer) -> list[dict]:
    return step_calls(layer, *tokens())


def test_recorder_sees_the_native_layers_forward_and_backward_calls():
    layer = native_cpu()
    calls = recorded(layer)
    roles = [call_role(call, H, F) for call in calls]
    assert sorted(roles) == sorted(ROLES), roles
    assert roles[:2] == ["fwd gate_up", "fwd down"], "the forward's two calls come first"
    assert {call["func"] for call in calls} == {torch.ops.aten._grouped_mm.default}
    fwd, wgrad = calls[roles.index("fwd gate_up")], calls[roles.index("wgrad gate_up")]
    assert fwd["a"].data_ptr() in (wgrad["a"].data_ptr(), wgrad["b"].data_ptr()), \
        "autograd's wgrad reads the rows the forward read (the tensor itself, not a copy)"
    assert wgrad["offs"] is not None and wgrad["offs"].data_ptr() == fwd["offs"].data_ptr()
    # the replay makes the gradient autograd made: the same tensors, the same arguments
    out = run_call(wgrad)
    assert [list(out.shape), list(out.stride()), str(out.dtype)] == \
        [wgrad["out"]["shape"], wgrad["out"]["stride"], "torch." + wgrad["out"]["dtype"]]
    grad = layer.gate_up.grad
    assert torch.equal(out, grad) or torch.equal(out.transpose(-2, -1), grad)
    down = run_call(calls[roles.index("wgrad down")])
    assert torch.equal(down, layer.down.grad) or torch.equal(down.transpose(-2, -1), layer.down.grad)


def test_recorder_records_nothing_outside_its_block_and_other_ops_never():
    layer = native_cpu()
    recorder = GroupedMMRecorder()
    with recorder:
        torch.randn(4, 4) @ torch.randn(4, 4)
    x_th, grad_th = tokens()
    step(layer, x_th, grad_th)
    assert recorder.calls == []


def test_roles_pair_ours_calls_with_the_native_layers():
    ours = MoonEPMoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K,
                                    max_tokens_per_rank=T, grouped_gemm="torch"), single_world("cpu"))
    try:
        ours_calls = recorded(ours)
    finally:
        ours.destroy()
    native_calls = recorded(native_cpu())
    ours_roles = [call_role(call, H, F) for call in ours_calls]
    native_roles = [call_role(call, H, F) for call in native_calls]
    assert sorted(ours_roles) == sorted(ROLES), ours_roles
    pairs = match_roles(ours_roles, native_roles)
    assert [role for role, _, _ in pairs] == list(ROLES)
    for role, i, j in pairs:
        mine, theirs = ours_calls[i], native_calls[j]
        assert ours_roles[i] == native_roles[j] == role
        assert mine["b"].dim() == theirs["b"].dim(), role
        if mine["b"].dim() == 3:  # fwd, dgrad: the same weight dims, the rows differ (ours are padded)
            assert mine["b"].shape == theirs["b"].shape
            assert mine["out"]["shape"][1] == theirs["out"]["shape"][1]
        else:  # wgrad: one gradient shape, up to the operand order
            assert sorted(mine["out"]["shape"]) == sorted(theirs["out"]["shape"])


def meta_call(a_shape, b_shape, offs=True) -> dict:
    a, b = torch.empty(a_shape, device="meta"), torch.empty(b_shape, device="meta")
    return {"a": a, "b": b, "offs": torch.empty(E, device="meta") if offs else None}


@pytest.mark.parametrize(("a_shape", "b_shape", "role"), [
    ((100, H), (E, H, 2 * F), "fwd gate_up"),
    ((100, F), (E, F, H), "fwd down"),
    ((100, H), (E, H, F), "dgrad down"),
    ((100, 2 * F), (E, 2 * F, H), "dgrad gate_up"),
    ((H, 100), (100, F), "wgrad down"),  # dy^T @ x
    ((F, 100), (100, H), "wgrad down"),  # x^T @ dy
    ((2 * F, 100), (100, H), "wgrad gate_up"),
    ((H, 100), (100, 2 * F), "wgrad gate_up"),
    ((100, H), (E, H, H), "other"),
    ((E, 100, H), (E, H, F), "other"),
])
def test_call_role_from_operand_dims(a_shape, b_shape, role):
    assert call_role(meta_call(a_shape, b_shape), H, F) == role


def test_call_role_needs_dims_that_tell_the_roles_apart():
    assert call_role(meta_call((H, 100), (100, F), offs=False), H, F) == "other", "no offs: not a wgrad"
    with pytest.raises(ValueError, match="same operand dims"):
        call_role(meta_call((100, 32), (E, 32, 32)), 32, 16)  # H = 2H': fwd gate_up looks like dgrad gate_up


def test_match_roles_pairs_in_order_and_keeps_the_unpaired():
    ours = ["fwd gate_up", "fwd down", "wgrad down", "dgrad down", "other", "wgrad gate_up", "wgrad gate_up"]
    native = ["fwd down", "fwd gate_up", "dgrad down", "wgrad down", "wgrad gate_up", "dgrad gate_up"]
    assert match_roles(ours, native) == [
        ("fwd gate_up", 0, 1), ("fwd down", 1, 0), ("dgrad down", 3, 2), ("wgrad down", 2, 3),
        ("dgrad gate_up", None, 5), ("wgrad gate_up", 5, 4), ("wgrad gate_up", 6, None), ("other", 4, None)]


def test_alternated_timings_runs_each_arm_equally_often_in_turns():
    log = []

    def arm(name):
        return lambda: log.append(name)

    times = alternated_timings([arm("A"), arm("B")], repeat=4, warmup=1,
                               before=[arm("flush A"), arm("flush B")], device="cpu")
    assert [len(t) for t in times] == [4, 4]
    runs = [name for name in log if "flush" not in name]
    assert runs == ["A", "B", "B", "A", "A", "B", "B", "A", "A", "B"], "rounds rotate: A B, B A, ..."
    assert log == [step for name in runs for step in (f"flush {name}", name)], "each run after its own before"


def test_alternated_timings_rotates_three_arms_and_checks_its_befores():
    log = []
    calls = [lambda name=name: log.append(name) for name in "ABC"]
    times = alternated_timings(calls, repeat=3, warmup=0, before=[None, None, lambda: log.append("x")],
                               device="cpu")
    assert log == ["A", "B", "x", "C", "B", "x", "C", "A", "x", "C", "A", "B"]
    assert all(len(t) == 3 and min(t) >= 0 for t in times)
    with pytest.raises(ValueError, match="3 calls but 2 befores"):
        alternated_timings(calls, repeat=1, before=[None, None], device="cpu")


def test_round_ratios_pair_the_rounds():
    ratios = round_ratios([2.0, 3.0, 9.0], [1.0, 3.0, 3.0])
    assert ratios == {"median": 2.0, "min": 1.0, "max": 3.0, "rounds": [2.0, 1.0, 3.0]}
    with pytest.raises(ValueError, match="equal, non-empty"):
        round_ratios([1.0], [1.0, 2.0])


def test_grouped_kernel_ms_takes_the_kernel_after_each_prepare():
    kernels = [("sm80_xmma_gemm", 0.5), ("void at::cuda::detail::prepare_grouped_gemm_data<..>", 0.002),
               ("cutlass::device_kernel<GemmUniversal<GroupProblemShape..>>", 7.6), ("cublas_gemm", 0.6),
               ("prepare_grouped_gemm_data", 0.002), ("cutlass grouped", 4.0)]
    assert grouped_kernel_ms(kernels) == [7.6, 4.0]
    assert grouped_kernel_ms([("prepare_grouped_gemm_data", 0.002)]) == []
    # a kernel of another stream (backward's combine beside the weight gradient) starting between the two
    beside = [("prepare_grouped_gemm_data<cutlass::bfloat16_t>", 0.002), ("_gather_routes_kernel", 0.26),
              ("cutlass::device_kernel<GemmUniversal<GroupProblemShape..>>", 8.7)]
    assert grouped_kernel_ms(beside) == [8.7]


def test_profiled_call_ms_takes_each_calls_median_and_spread_over_the_steps():
    def step(*ms):
        return [entry for m in ms for entry in (("prepare_grouped_gemm_data", 0.002), ("cutlass", m))]

    profiled = profiled_call_ms([step(7.0, 4.0), step(9.0, 4.5), step(8.0, 3.5)], num_calls=2)
    assert profiled == {"ms": [8.0, 4.0], "ms_min": [7.0, 3.5], "ms_max": [9.0, 4.5],
                        "step_ms": [11.0, 13.5, 11.5]}
    assert profiled_call_ms([step(7.0, 4.0), step(9.0)], num_calls=2) is None  # a step missing a call
    assert profiled_call_ms([step(7.0)], num_calls=2) is None
    assert profiled_call_ms([], num_calls=2) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_main_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.grouped_mm_calls"])
    with pytest.raises(SystemExit, match="needs a GPU"):
        main()


@pytest.mark.gpu
def test_alternated_timings_with_an_l2_flush_on_the_gpu():
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    flush = l2_flush(64, idle_ms=0.1)
    times = alternated_timings([lambda: a @ a, lambda: a @ a.T], repeat=3, before=[flush, flush])
    assert [len(t) for t in times] == [3, 3] and min(min(t) for t in times) > 0
