"""The serving path: variable token counts, padding, the Buffer pool, the weight layout, the communicator
facade and its stated capabilities. Threads world, float64, integer-valued data: every check is exact."""

from __future__ import annotations

import time

import pytest
import torch
from stress import comm_streams

from bench.common import captured_graph
from moonep_moe.base.sizes import next_power_of_2
from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.pool import BufferPool
from moonep_moe.config import load_config
from moonep_moe.engine.communicator import CommunicatorConfig, DispatchHandle, MoECommunicator
from moonep_moe.engine.layout import ExpertLayout
from moonep_moe.plan.types import decode_dst
from moonep_moe.transport.threads import run_ranks, single_world
from moonep_moe.transport.world import RankFailedError

F64 = torch.float64
R, S, H, K, E, TP = 4, 32, 8, 2, 16, 4
GLOBAL_FIELDS = ("experts_to_copy", "cu_seqlens", "zero_fill_ranges", "rank_load", "expert_load",
                 "slots_used")


def step_inputs(rank: int, num_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`num_tokens` real tokens: hidden `[t, H]` integers, weights `[t, K]` multiples of 1/8, distinct experts
    `[t, K]` int32 skewed towards rank 0's experts (so the plan replicates)."""
    gen = torch.Generator().manual_seed(100 * seed + rank)
    p_e = torch.ones(E, dtype=F64)
    p_e[: E // R] = 8
    topk = torch.multinomial(p_e.expand(num_tokens, E), K, generator=gen) if num_tokens else \
        torch.empty(0, K, dtype=torch.long)
    return dict(hidden=torch.randint(-8, 9, (num_tokens, H), generator=gen).to(F64),
                weights=torch.randint(1, 9, (num_tokens, K), generator=gen).to(F64) / 8,
                topk=topk.int())


def pad(x: dict[str, torch.Tensor], to: int, expert: int) -> dict[str, torch.Tensor]:
    """Pad to `to` tokens with zero rows, zero weights and routes to `expert` (-1, or vLLM's habit: 0)."""
    extra = to - x["hidden"].shape[0]
    return dict(hidden=torch.cat([x["hidden"], torch.zeros(extra, H, dtype=F64)]),
                weights=torch.cat([x["weights"], torch.zeros(extra, K, dtype=F64)]),
                topk=torch.cat([x["topk"], torch.full((extra, K), expert, dtype=torch.int32)]))


def histogram(topk: torch.Tensor) -> torch.Tensor:
    return torch.bincount(topk[topk >= 0].long(), minlength=E).int()


def run(buf: Buffer, x: dict[str, torch.Tensor], **kwargs):
    return buf.dispatch(x["hidden"], x["weights"], x["topk"], histogram(x["topk"]), **kwargs)


def expected_out(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """What combine returns when each expert row is its input times its route weight."""
    return (x["weights"] * (x["topk"] >= 0)).sum(1, keepdim=True) * x["hidden"]


# -- variable tokens ---------------------------------------------------------------------------------------

TOKENS = (1, 5, 0, 3)


def test_small_step_moves_only_its_routes():
    """A step with s << S tokens plans exactly its s*K routes and writes no row past its segments."""

    def fn(world):
        buf = Buffer(S, H, K, E, R, token_padding=TP, world=world, dtype=F64)
        buf.hidden_nvsh_buffer_view.fill_(77.0)  # sentinel: rows nobody may touch
        x = step_inputs(world.rank, TOKENS[world.rank])
        rows, weights_nvs, cu_seqlens, plan = run(buf, x, zero_copy=True)
        used = int(cu_seqlens[-1])
        untouched = bool((rows[used:] == 77.0).all())
        out, _, _ = buf.combine(plan, rows * weights_nvs[:, None])
        return plan.clone(), used, untouched, out, x, buf.NvS

    results = run_ranks(fn, R)
    plan = results[0][0]
    assert int(plan.rank_load.sum()) == sum(TOKENS) * K
    assert int(plan.expert_load.sum()) == sum(TOKENS) * K
    assert max(plan.rank_load.tolist()) - min(plan.rank_load.tolist()) <= 1
    for rank, (plan_r, used, untouched, out, x, rows_per_rank) in enumerate(results):
        assert plan_r.num_routes == TOKENS[rank] * K
        assert used <= (int(plan.rank_load[rank]) + (TP - 1) * (E // R + plan.B)) < rows_per_rank
        assert untouched, "rows past the step's segments are never written"
        assert torch.equal(out, expected_out(x))


@pytest.mark.parametrize("pad_expert", [-1, 0])
def test_padding_with_minus_one_keeps_the_plan_expert_zero_skews_it(pad_expert):
    """Padding each rank's step to S with -1 routes gives the unpadded step's plan; padding with expert 0
    and weight 0 (the vLLM/SGLang habit) gives the same outputs but a different, skewed plan."""

    def fn(world):
        buf = Buffer(S, H, K, E, R, token_padding=TP, world=world, dtype=F64)
        x = step_inputs(world.rank, TOKENS[world.rank], seed=1)
        _, _, _, plan = run(buf, x)
        plain = plan.clone()
        rows, weights_nvs, _, plan = run(buf, pad(x, S, pad_expert))
        out, _, _ = buf.combine(plan, rows * weights_nvs[:, None])
        return plain, plan.clone(), out[: TOKENS[world.rank]], x

    results = run_ranks(fn, R)
    for plain, padded, out, x in results:
        assert torch.equal(out, expected_out(x)), "outputs of the real tokens never change"
        same = [torch.equal(getattr(plain, f), getattr(padded, f)) for f in GLOBAL_FIELDS]
        real_dst = padded.dst[: plain.num_routes]
        if pad_expert == -1:
            assert all(same) and torch.equal(real_dst, plain.dst)
            assert (decode_dst(padded.dst[plain.num_routes:], padded.NvS)[3] == 0).all(), "padding not sent"
        else:
            assert not all(same)
    if pad_expert == 0:
        plain, padded = results[0][0], results[0][1]
        padding_routes = (R * S - sum(TOKENS)) * K
        assert int(padded.expert_load[0]) == int(plain.expert_load[0]) + padding_routes
        assert int(padded.rank_load.sum()) == int(plain.rank_load.sum()) + padding_routes


# -- the in-flight guard -----------------------------------------------------------------------------------


def test_two_inflight_zero_copy_steps_raise_and_training_order_stays_legal():
    world = single_world()
    buf = Buffer(S, H, K, E, 1, token_padding=TP, world=world, dtype=F64)
    x, y = step_inputs(0, 6), step_inputs(0, 9, seed=2)
    rows, _, _, plan = run(buf, x, zero_copy=True)
    with pytest.raises(RuntimeError, match="two in-flight steps cannot share one Buffer"):
        run(buf, y)
    assert torch.equal(rows, buf.hidden_nvsh_buffer_view), "the refused step wrote nothing"
    buf.combine(plan, rows, zero_copy=True)
    # training: forward dispatch -> combine -> backward dispatch(plan) -> combine -> next step
    rows, _, _, plan = run(buf, x, zero_copy=True)
    buf.combine(plan, rows.clone())
    grad_rows, _, _, _ = buf.dispatch(x["hidden"], None, None, None, plan=plan)
    buf.combine(plan, grad_rows, torch.zeros(buf.NvS, dtype=F64))
    run(buf, y, zero_copy=True)
    buf.end_step()  # the step failed before its combine: the next one may run
    _, _, _, plan = run(buf, x)
    run(buf, y)  # copy-mode steps own their rows: not tracked
    buf.destroy()


# -- the pool ----------------------------------------------------------------------------------------------


def test_pool_capacity_is_the_group_max_and_buffers_are_lazy():
    capacity_s = 24  # not a power of two: the largest Buffer has exactly S

    def fn(world):
        pool = BufferPool(capacity_s, H, K, E, world=world, token_padding=TP, dtype=F64, min_capacity=2)
        seen = []
        for tokens_r in ((1, 0, 1, 1), (0, 3, 1, 2), (5, 1, 0, 0), (24, 1, 0, 3), (4, 4, 4, 4), (0, 0, 0, 0)):
            buf = pool.get(tokens_r[world.rank])
            x = step_inputs(world.rank, tokens_r[world.rank])
            rows, weights_nvs, _, plan = run(buf, x)
            out, _, _ = buf.combine(plan, rows * weights_nvs[:, None])
            assert torch.equal(out, expected_out(x))
            seen.append(buf.S)
        stats = pool.stats()
        keys = list(world.group._registry)
        pool.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            pool.get(1)
        registry = list(world.group._registry.items())
        mine_left = [key for key, slots in registry if slots[world.rank] is not None]
        return seen, stats, keys, mine_left

    results = run_ranks(fn, R)
    for seen, stats, keys, left in results:
        assert seen == [2, 4, 8, 24, 4, 2]
        assert stats["capacities"] == [2, 4, 8, 24]
        nvs = stats["rows_per_rank"]
        # rows (float64) and route weights per row of NvS, and the duplicate pairs (2 int32 per route slot)
        assert stats["bytes"] == [n * (H * 8 + 8) + R * c * K * 8 for n, c in zip(nvs, stats["capacities"],
                                                                                 strict=True)]
        assert stats["total_bytes"] == sum(stats["bytes"]) and nvs == sorted(nvs) and nvs[0] < nvs[-1]
        assert keys and not left, "destroy() releases every Buffer"


def test_pool_rejects_too_many_tokens():
    pool = BufferPool(S, H, K, E, world=single_world(), dtype=F64)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.get(S + 1)
    with pytest.raises(ValueError, match="min_capacity"):
        BufferPool(S, H, K, E, world=single_world(), dtype=F64, min_capacity=S + 1)


def test_pool_never_hands_out_a_buffer_destroyed_directly():
    """A Buffer of the pool destroyed by hand (`buffer.destroy()`, collectively) is dropped: the next step of
    its capacity gets a new Buffer, which runs, and the pool's stats count only live Buffers."""
    pool = BufferPool(S, H, K, E, world=single_world(), token_padding=TP, dtype=F64)
    destroyed = pool.get(4)
    destroyed.destroy()
    buf = pool.get(4)
    assert buf is not destroyed and not buf.destroyed
    x = step_inputs(0, 4)
    rows, weights_nvs, _, plan = run(buf, x)
    assert torch.equal(buf.combine(plan, rows * weights_nvs[:, None])[0], expected_out(x))
    assert pool.stats()["capacities"] == [4]
    pool.destroy()


def test_fixed_token_count_is_one_buffer_and_no_extra_gather():
    """`variable_tokens=False`: one Buffer of capacity S serves every step, so the step reads no token
    counts: one all-gather per step (the histogram the plan needs), where the pool of capacities adds one of
    every rank's token count (a host read on a GPU)."""
    steps = ((3, 0, 7, 1), (S, 2, 1, 1))

    def fn(world):
        gathers = []
        gather = world.all_gather
        world.all_gather = lambda tensor: gathers.append(tensor.shape) or gather(tensor)
        counts = {}
        for variable in (True, False):
            comm = MoECommunicator(comm_config(variable_tokens=variable), world=world)
            before = len(gathers)
            for tokens_r in steps:
                x = step_inputs(world.rank, tokens_r[world.rank])
                out, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"])
                y_th = comm.combine(out.tokens_nvsh * out.weights_nvs[:, None], handle)
                assert torch.equal(y_th, expected_out(x))
            counts[variable] = (len(gathers) - before, comm.capacities, comm.stats()["capacities"])
            comm.destroy()
        return counts

    for counts in run_ranks(fn, R):
        assert counts[True][0] == 2 * len(steps)
        assert counts[False] == (len(steps), [S], [S])


# -- weight layout -----------------------------------------------------------------------------------------

F = 6


def model_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randint(-9, 10, (E, 2 * F, H), generator=gen).to(F64),
            torch.randint(-9, 10, (E, H, F), generator=gen).to(F64))


@pytest.mark.parametrize("source", ["fused", "per_expert"])
def test_layout_holds_only_home_experts_and_slots(source):
    w13, w2 = model_weights()
    B = 2

    def fn(world):
        asked = []

        def expert_weights(e):
            asked.append(e)
            return w13[e, :F], w13[e, F:], w2[e]

        if source == "fused":
            layout = ExpertLayout.from_fused(world, w13, w2, num_slots=B, name="layer0")
        else:
            layout = ExpertLayout.from_experts(world, expert_weights, E, num_slots=B, name="layer0",
                                               dtype=F64)
        return layout, asked

    epn = E // R
    for rank, (layout, asked) in enumerate(run_ranks(fn, R)):
        home = slice(rank * epn, (rank + 1) * epn)
        assert layout.local_expert_start == rank * epn and layout.num_local_experts == epn
        assert torch.equal(layout.gate_up.home.local, w13[home])
        assert torch.equal(layout.down.home.local, w2[home])
        for rows, full in ((layout.gate_up, w13), (layout.down, w2)):
            assert rows.home.local.shape[0] + rows.slots.local.shape[0] <= epn + B
            assert rows.home.local.untyped_storage().nbytes() == full[home].nbytes, "a copy of the slice only"
        assert layout.nbytes == (epn + B) * (w13[0].nbytes + w2[0].nbytes)
        assert asked == ([] if source == "fused" else list(range(rank * epn, (rank + 1) * epn)))


def test_layout_errors():
    w13, w2 = model_weights()
    with pytest.raises(ValueError, match="w2 must be"):
        ExpertLayout.from_fused(single_world(), w13, w2[:, :, :-1], num_slots=0, name="x")
    with pytest.raises(RankFailedError, match="rank 0 failed: ValueError: .*divisible"):
        run_ranks(lambda world: ExpertLayout.from_fused(world, w13[:6], w2[:6], num_slots=0, name="x"), 4)
    with pytest.raises(ValueError, match="num_slots"):
        ExpertLayout.from_fused(single_world(), w13, w2, num_slots=1, name="x")


# -- the communicator --------------------------------------------------------------------------------------


def comm_config(**overrides) -> CommunicatorConfig:
    fields = dict(hidden_size=H, num_experts=E, top_k=K, max_tokens_per_rank=S, token_padding=TP,
                  dtype="float64")
    return CommunicatorConfig(**{**fields, **overrides})


def swiglu_experts(out, layout: ExpertLayout, epn: int) -> torch.Tensor:
    """A plain per-group SwiGLU runner, as an engine would write it, from the DispatchOutput layout."""
    y_nvsh = torch.zeros_like(out.tokens_nvsh)
    starts = [0, *out.offsets_g.tolist()[:-1]]
    for g, (start, expert) in enumerate(zip(starts, out.expert_ids_g.tolist(), strict=True)):
        if expert < 0:
            continue
        rows = slice(start, start + int(out.num_tokens_per_expert_g[g]))
        rows_w = layout.gate_up.home.local if g < epn else layout.gate_up.slots.local
        rows_d = layout.down.home.local if g < epn else layout.down.slots.local
        j = g if g < epn else g - epn
        gate_up = out.tokens_nvsh[rows] @ rows_w[j].T
        hidden = torch.nn.functional.silu(gate_up[:, :F]) * gate_up[:, F:]
        y_nvsh[rows] = (hidden @ rows_d[j].T) * out.weights_nvs[rows, None]
    return y_nvsh


def grouped_swiglu(out, layout: ExpertLayout) -> torch.Tensor:
    """`swiglu_experts` without a host read, so it can be captured in a CUDA graph: each row's group found by
    a search of `offsets_g`, its expert's weights gathered per row; rows past the groups give zero."""
    offsets_g = out.offsets_g
    row_v = torch.arange(out.tokens_nvsh.shape[0], dtype=offsets_g.dtype, device=offsets_g.device)
    group_v = torch.searchsorted(offsets_g, row_v, right=True)
    used_v = group_v < offsets_g.shape[0]
    group_v = group_v.clamp(max=offsets_g.shape[0] - 1)
    w13_g = torch.cat([layout.gate_up.home.local, layout.gate_up.slots.local])
    w2_g = torch.cat([layout.down.home.local, layout.down.slots.local])
    gate_up_v = torch.bmm(w13_g[group_v], out.tokens_nvsh[:, :, None])[:, :, 0]
    hidden_v = torch.nn.functional.silu(gate_up_v[:, :F]) * gate_up_v[:, F:]
    y_nvsh = torch.bmm(w2_g[group_v], hidden_v[:, :, None])[:, :, 0] * out.weights_nvs[:, None]
    return torch.where(used_v[:, None], y_nvsh, 0)


def dense_moe(x: dict[str, torch.Tensor], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x["hidden"])
    for t in range(x["hidden"].shape[0]):
        for k in range(K):
            e = int(x["topk"][t, k])
            if e >= 0:
                gate_up = w13[e] @ x["hidden"][t]
                out[t] += x["weights"][t, k] * (w2[e] @ (torch.nn.functional.silu(gate_up[:F]) * gate_up[F:]))
    return out


@pytest.mark.parametrize("use_async", [False, True])
def test_communicator_runs_an_engine_step_against_a_dense_reference(use_async):
    w13, w2 = model_weights()
    steps = ((3, 0, 7, 1), (S, S, S, S), (2, 1, 1, 1))

    def fn(world):
        comm = MoECommunicator(comm_config(), world=world)
        layout = ExpertLayout.from_fused(world, w13, w2, num_slots=comm.num_slots, name="layer0")
        epn = comm.num_local_experts
        results = []
        for step, tokens_r in enumerate(steps):
            x = step_inputs(world.rank, tokens_r[world.rank], seed=step)
            x["topk"][::3, 1] = -1  # some padding routes
            if use_async:
                out, handle = comm.dispatch_async(x["hidden"], x["topk"], x["weights"]).wait()
            else:
                out, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"])
            comm.prefetch_weights(handle, layout)
            ids = out.expert_ids_g.tolist()
            assert ids[:epn] == list(range(comm.local_expert_start, comm.local_expert_start + epn))
            sizes_g = torch.diff(out.offsets_g, prepend=out.offsets_g.new_zeros(1))
            assert (out.num_tokens_per_expert_g <= sizes_g).all() and (sizes_g % TP == 0).all()
            for g, e in enumerate(ids):
                assert e >= 0 or int(sizes_g[g]) == 0
            y_nvsh = swiglu_experts(out, layout, epn)
            if use_async:
                y_th = comm.combine_async(y_nvsh, handle).wait()
            else:
                y_th = comm.combine(y_nvsh, handle)
            results.append((x, y_th, handle._buffer.S, int(out.num_tokens_per_expert_g.sum())))
        stats = comm.stats()
        comm.destroy()
        return results, stats

    outputs = run_ranks(fn, R)
    for step, tokens_r in enumerate(steps):
        assert sum(outputs[r][0][step][3] for r in range(R)) == sum(
            int((outputs[r][0][step][0]["topk"] >= 0).sum()) for r in range(R)), "every valid route once"
        for r in range(R):
            x, y_th, capacity, _ = outputs[r][0][step]
            assert capacity == next_power_of_2(max(tokens_r))
            torch.testing.assert_close(y_th, dense_moe(x, w13, w2), rtol=1e-12, atol=1e-9)
    assert outputs[0][1]["capacities"] == [2, 8, S]


def test_communicator_unweighted_in_place_and_misuse():
    comm = MoECommunicator(comm_config(), world=single_world())
    x = step_inputs(0, 5)
    out, handle = comm.dispatch(x["hidden"], x["topk"])
    assert out.weights_nvs is None
    y_th = comm.combine(out.tokens_nvsh, handle)  # identity experts, written in place
    assert torch.equal(y_th, K * x["hidden"])
    with pytest.raises(RuntimeError, match="already combined"):
        comm.combine(out.tokens_nvsh, handle)
    other = MoECommunicator(comm_config(), world=single_world())
    _, foreign = other.dispatch(x["hidden"], x["topk"], x["weights"])
    with pytest.raises(ValueError, match="handle"):
        comm.combine(out.tokens_nvsh, foreign)
    assert isinstance(foreign, DispatchHandle)
    comm.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        comm.dispatch(x["hidden"], x["topk"])


def test_communicator_from_moe_config_and_keywords():
    cfg = load_config("tiny-cpu", ep_size=1, max_tokens_per_rank=16)
    comm = MoECommunicator(cfg, world=single_world(), dtype="float64")
    assert comm.config.hidden_size == cfg.hidden_size and comm.dtype == F64
    assert (comm.num_local_experts, comm.local_expert_start) == (cfg.num_experts, 0)
    keywords = MoECommunicator(world=single_world(), hidden_size=H, num_experts=E, top_k=K,
                               max_tokens_per_rank=S)
    assert keywords.config == comm_config(token_padding=16, dtype="bfloat16")  # CommConfig's default


def test_communicator_takes_a_layers_comm_config():
    """`MoEConfig.comm` (a plain `CommConfig`) configures a communicator like the `MoEConfig` itself."""
    cfg = load_config("tiny-cpu", ep_size=1, max_tokens_per_rank=16)
    from_comm = MoECommunicator(cfg.comm, world=single_world(), dtype="float64")
    from_layer = MoECommunicator(cfg, world=single_world(), dtype="float64")
    assert type(from_comm.config) is CommunicatorConfig and from_comm.config == from_layer.config


# -- capabilities, stated and enforced --------------------------------------------------------------------


def test_capabilities_are_stated():
    """Yes only where a test exercises it: async and CUDA graphs by the gpu tests below and
    tests/test_engine_contract.py, two steps in flight by `test_two_steps_in_flight_equal_one_by_one`, FP8
    dispatch by tests/test_fp8_dispatch.py."""
    assert MoECommunicator.capabilities() == dict(
        supports_async=True, supports_backward=False, supports_cuda_graph=True, supports_expert_bias=False,
        supports_multiple_inflight_steps=True, supports_quantized_dispatch=True,
        supports_variable_tokens=True)


@pytest.mark.parametrize(("overrides", "error", "match"), [
    (dict(expert_bias=True), NotImplementedError, "supported: expert_bias=False"),
    (dict(quantization="mxfp8"), NotImplementedError, "supported: 'none' .* and 'fp8_e4m3'"),
    (dict(quantization="fp8_e4m3", hidden_size=4, dtype="bfloat16"), ValueError,
     "hidden_size=4: e4m3 rows with their scales take 16 bytes, more than a bfloat16 row's 8"),
    (dict(num_local_experts=3), ValueError, "only contiguous blocks"),
    (dict(local_expert_start=5), ValueError, "only contiguous blocks"),
    (dict(ep_size=2), ValueError, "ep_size=2"),
    (dict(num_experts=6, top_k=2), ValueError, "divisible"),
])
def test_unsupported_options_raise_at_construction(overrides, error, match):
    def fn(world):
        with pytest.raises(error, match=match):
            MoECommunicator(comm_config(**overrides), world=world)

    run_ranks(fn, 4)


def test_quantised_activations_raise_at_the_first_call():
    """Without `quantization='fp8_e4m3'` (tests/test_fp8_dispatch.py has it)."""
    comm = MoECommunicator(comm_config(), world=single_world())
    x = step_inputs(0, 4)
    with pytest.raises(ValueError, match="quantised dispatch.*needs quantization='fp8_e4m3'.*float64"):
        comm.dispatch(x["hidden"].to(torch.float8_e4m3fn), x["topk"], x["weights"])


def test_two_inflight_steps_on_one_communicator_raise():
    comm = MoECommunicator(comm_config(), world=single_world())
    x = step_inputs(0, 4)
    out, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"])
    with pytest.raises(RuntimeError, match="rank 0: 1 steps of capacity 4 are in flight .*"
                                           "max_inflight_steps=1"):
        comm.dispatch(x["hidden"], x["topk"], x["weights"])
    assert torch.equal(comm.combine(out.tokens_nvsh * out.weights_nvs[:, None], handle), expected_out(x))
    _, failed = comm.dispatch(x["hidden"], x["topk"], x["weights"])
    comm.discard(failed)  # the runner failed: the next step may run
    out, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"])
    assert torch.equal(comm.combine(out.tokens_nvsh * out.weights_nvs[:, None], handle), expected_out(x))


def test_communicator_errors_name_its_arguments_and_the_rank():
    """Errors speak of the facade's arguments (input_th, topk_ids_tk, weights_tk, expert_output_nvsh), not
    of the Buffer's internal names, and name the rank."""
    comm = MoECommunicator(comm_config(), world=single_world())
    x = step_inputs(0, 4)
    hidden, topk, weights = x["hidden"], x["topk"], x["weights"]
    out_of_range = topk.clone()
    out_of_range[1, 0] = E
    bad_calls = [
        ((hidden.float(), topk, weights), "rank 0: input_th must have dtype"),
        ((torch.zeros(S + 1, H, dtype=F64), topk, None), "rank 0: input_th must be a"),
        ((hidden, topk.float(), weights), "rank 0: topk_ids_tk must have dtype"),
        ((hidden, topk[:, :1], weights), "rank 0: topk_ids_tk must have shape"),
        ((hidden, topk, weights.float()), "rank 0: weights_tk must have dtype"),
        ((hidden, out_of_range, weights), f"rank 0: topk_ids_tk holds expert id {E}"),
    ]
    for args, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            comm.dispatch(*args)
    out, handle = comm.dispatch(hidden, topk, weights)
    with pytest.raises(ValueError, match="rank 0: expert_output_nvsh must have shape"):
        comm.combine(out.tokens_nvsh[:-1], handle)
    assert torch.equal(comm.combine(out.tokens_nvsh * out.weights_nvs[:, None], handle), expected_out(x))
    comm.destroy()


OUTPUT_FIELDS = ("tokens_nvsh", "weights_nvs", "num_tokens_per_expert_g", "offsets_g", "expert_ids_g")


def fill_with_another_step(comm: MoECommunicator) -> None:
    """Run a step of other tokens and routing through `comm` as requests (which creates its comm stream), so
    that the Buffer's rows and the comm stream's freed memory hold values unlike the step under test: a
    read of that step's results that does not wait for them sees these."""
    other = {k: v.cuda() for k, v in step_inputs(0, S, seed=1).items()}
    out, handle = comm.dispatch_async(other["hidden"], other["topk"], other["weights"]).wait()
    comm.combine_async(out.tokens_nvsh * out.weights_nvs[:, None], handle).wait()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("use_async", [False, True])
def test_communicator_results_are_final_on_the_callers_stream_while_the_comm_stream_is_busy(use_async):
    """`dispatch_async` / `combine_async` run each step on the Buffer's comm stream, `dispatch` / `combine`
    on the caller's stream. With the comm stream kept busy (a long sleep queued on it before each call),
    what the caller's stream reads at once (after `wait()`) must be the final result (it differed in 3 of 3
    trials on the H200 when the calls, then all on the comm stream, returned without that wait). The
    Buffer's memory first holds another step's results (`fill_with_another_step`), so a `wait()` that does
    not wait reads values unlike the final ones (the same step run before would leave equal values there,
    which such a read would pass on)."""
    comm = MoECommunicator(comm_config(), world=single_world("cuda"))
    x = {k: v.cuda() for k, v in step_inputs(0, S).items()}
    want, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"])
    want = {f: getattr(want, f).clone() for f in OUTPUT_FIELDS}
    comm.combine(want["tokens_nvsh"] * want["weights_nvs"][:, None], handle)
    fill_with_another_step(comm)
    end = int(want["offsets_g"][-1])  # the rows past it are unspecified: the other step's stay there
    (comm_stream,) = comm_streams(comm.world)

    def busy(call):
        with torch.cuda.stream(comm_stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s on an H200: far longer than the caller's reads below
        return call().wait() if use_async else call()

    send = comm.dispatch_async if use_async else comm.dispatch
    out, handle = busy(lambda: send(x["hidden"], x["topk"], x["weights"]))
    read = {f: getattr(out, f).clone() for f in want}  # on the caller's stream, at once
    for field, value in want.items():
        defined = slice(0, end) if field in ("tokens_nvsh", "weights_nvs") else slice(None)
        assert torch.equal(read[field][defined], value[defined]), field
    y_nvsh = out.tokens_nvsh * out.weights_nvs[:, None]
    gather = comm.combine_async if use_async else comm.combine
    y_read = busy(lambda: gather(y_nvsh, handle)).clone()
    assert torch.equal(y_read, expected_out(x))
    comm.destroy()


# -- two steps in flight, requests, buckets ------------------------------------------------------------------


def engine_step(comm: MoECommunicator, layout: ExpertLayout, out, handle) -> torch.Tensor:
    """prefetch -> experts -> combine of one dispatched step."""
    comm.prefetch_weights(handle, layout)
    return comm.combine(grouped_swiglu(out, layout), handle)


def test_two_steps_in_flight_equal_one_by_one():
    """Two-batch overlap: with max_inflight_steps=2, step B is dispatched before step A is combined (each on
    its own Buffer of the same capacity; B is combined first): the outputs equal running A then B one by
    one, bit for bit, and equal the dense reference. A third step in flight raises."""
    w13, w2 = model_weights()

    def fn(world):
        comm = MoECommunicator(comm_config(max_inflight_steps=2, min_capacity=8), world=world)
        layout = ExpertLayout.from_fused(world, w13, w2, num_slots=comm.num_slots, name="layer0")
        a, b = (step_inputs(world.rank, 5 + world.rank, seed=seed) for seed in (3, 4))
        for x in (a, b):
            x["topk"][::4, 0] = -1
        one_by_one = [engine_step(comm, layout, *comm.dispatch(x["hidden"], x["topk"], x["weights"]))
                      for x in (a, b)]
        out_a, handle_a = comm.dispatch(a["hidden"], a["topk"], a["weights"])
        out_b, handle_b = comm.dispatch(b["hidden"], b["topk"], b["weights"])
        with pytest.raises(RuntimeError, match="max_inflight_steps=2"):
            comm.dispatch(a["hidden"], a["topk"], a["weights"])
        comm.prefetch_weights(handle_a, layout)
        y_a_nvsh = grouped_swiglu(out_a, layout)
        comm.prefetch_weights(handle_b, layout)
        y_b_nvsh = grouped_swiglu(out_b, layout)
        overlapped_b = comm.combine(y_b_nvsh, handle_b)
        overlapped_a = comm.combine(y_a_nvsh, handle_a)
        stats = comm.stats()
        comm.destroy()
        two_buffers = handle_a._buffer is not handle_b._buffer
        return (a, b), one_by_one, [overlapped_a, overlapped_b], two_buffers, stats

    for steps, one_by_one, overlapped, two_buffers, stats in run_ranks(fn, R):
        assert two_buffers and stats["capacities"] == [8, 8]
        for x, alone, overlap in zip(steps, one_by_one, overlapped, strict=True):
            assert torch.equal(overlap, alone)
            torch.testing.assert_close(overlap, dense_moe(x, w13, w2), rtol=1e-12, atol=1e-9)


def test_requests_on_the_cpu_complete_at_once():
    """Off CUDA a request has completed when it is returned (documented on `CommRequest`); `wait()` returns
    the result, the same object when called again; `combine_async(..., out=)` writes the caller's tensor."""
    comm = MoECommunicator(comm_config(), world=single_world())
    x = step_inputs(0, 6)
    request = comm.dispatch_async(x["hidden"], x["topk"], x["weights"])
    assert request.is_completed()
    out, handle = request.wait()
    assert request.wait()[0] is out
    out_th = torch.full_like(x["hidden"], 7.0)
    combined = comm.combine_async(out.tokens_nvsh * out.weights_nvs[:, None], handle, out=out_th)
    assert combined.is_completed()
    assert combined.wait() is out_th and torch.equal(out_th, expected_out(x))
    comm.destroy()


def test_capacity_names_the_bucket_and_out_is_checked():
    """`capacity=` picks the bucket without the group's count (what a CUDA graph needs); a capacity that is
    no bucket, or smaller than the step, raises naming it; so does a wrong `out`."""
    comm = MoECommunicator(comm_config(min_capacity=2), world=single_world())
    assert comm.capacities == [2, 4, 8, 16, S]
    x = step_inputs(0, 3)
    out, handle = comm.dispatch(x["hidden"], x["topk"], x["weights"], capacity=16)
    assert handle._buffer.S == 16
    y_nvsh = out.tokens_nvsh * out.weights_nvs[:, None]
    for bad_out in (torch.zeros(4, H, dtype=F64), torch.zeros(3, H), "out"):
        with pytest.raises(ValueError, match=r"rank 0: out must be a \[3, 8\] torch.float64 tensor on cpu"):
            comm.combine(y_nvsh, handle, out=bad_out)
    out_th = torch.empty(3, H, dtype=F64)
    assert comm.combine(y_nvsh, handle, out=out_th) is out_th and torch.equal(out_th, expected_out(x))
    for capacity in (3, 1, 2, S + 1):
        with pytest.raises(ValueError, match=rf"rank 0: capacity must be one of \[2, 4, 8, 16, 32\] and >= "
                                             rf"the step's 3 tokens, got {capacity}"):
            comm.dispatch(x["hidden"], x["topk"], x["weights"], capacity=capacity)
    comm.destroy()


@pytest.mark.gpu
def test_cuda_graph_per_bucket_replays_new_routing():
    """dispatch -> experts -> combine captured once per bucket (4 and S), replayed with new routing and t =
    bucket, 1, bucket // 2 + 1 real tokens (the rest padded with -1): the real tokens' outputs equal the dense
    reference, the padding's are zero. One rank on one GPU (its barriers are no-ops)."""
    w13, w2 = model_weights()
    world = single_world("cuda")
    comm = MoECommunicator(comm_config(dtype="float32", check_expert_ids=False), world=world)
    layout = ExpertLayout.from_fused(world, w13, w2, num_slots=comm.num_slots, name="graph",
                                     dtype=torch.float32)
    for bucket in (4, S):
        x = {k: v.cuda() for k, v in step_inputs(0, bucket).items()}
        static = dict(hidden=x["hidden"].float(), weights=x["weights"].float(), topk=x["topk"])
        out_th = torch.empty(bucket, H, device="cuda")

        def step(static=static, bucket=bucket, out_th=out_th):
            out, handle = comm.dispatch(static["hidden"], static["topk"], static["weights"], capacity=bucket)
            comm.prefetch_weights(handle, layout)
            comm.combine(grouped_swiglu(out, layout), handle, out=out_th)

        graph = captured_graph(step)
        for seed, tokens in enumerate((bucket, 1, bucket // 2 + 1)):
            x = pad(step_inputs(0, tokens, seed=seed + 10), bucket, -1)
            for name, value in x.items():
                static[name].copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            want = dense_moe(x, w13, w2)
            torch.testing.assert_close(out_th.cpu().double(), want, rtol=1e-4, atol=1e-3)
            assert not out_th[tokens:].any(), "padding tokens combine to zero"
    comm.destroy()


@pytest.mark.gpu
def test_async_request_returns_before_the_device_is_done():
    """With the caller's stream busy (a sleep, like the previous micro-batch's experts), `dispatch_async` and
    `combine_async` return at once without a host sync (sync debug mode "error"), `is_completed()` is False
    until the device is done, and `wait()` orders the caller's stream after them: the results are exact."""
    comm = MoECommunicator(comm_config(check_expert_ids=False), world=single_world("cuda"))
    x = {k: v.cuda() for k, v in step_inputs(0, S).items()}
    fill_with_another_step(comm)  # first use (compiles); a read that does not wait sees that step's rows
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s on an H200, queued on the caller's stream
    start = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sent = comm.dispatch_async(x["hidden"], x["topk"], x["weights"], capacity=S)
        pending = [sent.is_completed()]
        out, handle = sent.wait()
        combined = comm.combine_async(out.tokens_nvsh * out.weights_nvs[:, None], handle)
        pending.append(combined.is_completed())
        y_th = combined.wait()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    returned_s = time.perf_counter() - start
    assert pending == [False, False] and returned_s < 0.25, (pending, returned_s)
    torch.cuda.synchronize()
    assert sent.is_completed() and combined.is_completed()
    assert torch.equal(y_th, expected_out(x))
    comm.destroy()
