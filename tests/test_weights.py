"""Home experts, shared slot pools and checkpoints."""

from __future__ import annotations

import pytest
import torch

from moonep_moe.config import MoEConfig
from moonep_moe.layers.dense import dense_step
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
E, H, F, K = 16, 8, 6, 2  # H != 2F: a transposed fused gate_up is recognisable


def config(R: int, S: int = 32) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_size=R,
                     max_tokens_per_rank=S, token_padding=4, dtype="float64",
                     router={"dtype": "float64"}, grouped_gemm="reference")


def full_checkpoint(seed: int, router_skew: float = 0.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen, dtype=F64)
    router[:2] += router_skew  # tokens near +1 along every axis prefer experts 0 and 1
    return {"router.weight": router,
            "experts.gate_up_proj": torch.randn(E, 2 * F, H, generator=gen, dtype=F64),
            "experts.down_proj": torch.randn(E, H, F, generator=gen, dtype=F64)}


def per_expert(state: dict[str, torch.Tensor], names=("gate_proj", "up_proj", "down_proj")):
    """The fused checkpoint rewritten as per-expert entries under `names`."""
    gate, up, down = names
    out = {"router.weight": state["router.weight"]}
    for e in range(E):
        out[f"experts.{e}.{gate}.weight"] = state["experts.gate_up_proj"][e, :F]
        out[f"experts.{e}.{up}.weight"] = state["experts.gate_up_proj"][e, F:]
        out[f"experts.{e}.{down}.weight"] = state["experts.down_proj"][e]
    return out


def forward_all(R: int, state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Load `state` on an R-rank group, split `tokens` over the ranks, return all outputs in order."""
    chunks = tokens.chunk(R)

    def rank_fn(world):
        layer = MoonEPMoELayer(config(R, S=len(chunks[0])), world)
        layer.load_state_dict(state)
        return layer(chunks[world.rank]).detach()

    return torch.cat(run_ranks(rank_fn, R))


def test_state_dict_holds_home_experts_by_global_id_and_no_slots():
    def rank_fn(world):
        layer = MoonEPMoELayer(config(4), world)
        return layer.state_dict(), [name for name, _ in layer.named_parameters()]

    for rank, (state, params) in enumerate(run_ranks(rank_fn, 4)):
        experts = sorted({int(k.split(".")[1]) for k in state if k.startswith("experts.")})
        assert experts == list(range(rank * 4, rank * 4 + 4))
        assert state[f"experts.{rank * 4}.gate_proj.weight"].shape == (F, H)
        assert state[f"experts.{rank * 4}.down_proj.weight"].shape == (H, F)
        assert not any("slot" in k or "pool" in k for k in list(state) + params)
        assert sorted(params) == ["experts.down", "experts.gate_up", "router.weight"]


def test_checkpoint_saved_at_ep4_loads_at_ep1_and_ep2_with_identical_outputs():
    source = full_checkpoint(seed=0, router_skew=2.0)

    def save_rank(world):
        layer = MoonEPMoELayer(config(4), world)
        layer.load_state_dict(source)
        return layer.state_dict()

    merged = {}
    for shard in run_ranks(save_rank, 4):
        merged.update(shard)
    tokens = torch.randn(32, H, generator=torch.Generator().manual_seed(1), dtype=F64) + 0.5
    out4 = forward_all(4, merged, tokens)
    torch.testing.assert_close(forward_all(1, merged, tokens), out4, **TOL)
    torch.testing.assert_close(forward_all(2, merged, tokens), out4, **TOL)


def saved(R: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` loaded on an R-rank group, then every rank's `state_dict()` merged."""

    def rank_fn(world):
        layer = MoonEPMoELayer(config(R), world)
        layer.load_state_dict(state)
        return layer.state_dict()

    return {k: v for shard in run_ranks(rank_fn, R) for k, v in shard.items()}


def test_saved_names_hold_their_halves_and_round_trip_through_fused_layouts():
    """Distinct per-expert gate, up and down, given in transformers' fused layout (`gate_up_proj`: gate rows
    first): each saved name holds its own projection, and the saved experts fused again (`gate_up_proj` /
    `down_proj`, vLLM's `w13` / `w2`) load at another EP size into the same checkpoint."""
    gen = torch.Generator().manual_seed(5)
    gate, up = torch.randn(E, F, H, generator=gen, dtype=F64), torch.randn(E, F, H, generator=gen, dtype=F64)
    down = torch.randn(E, H, F, generator=gen, dtype=F64)
    router = torch.randn(E, H, generator=gen, dtype=F64)
    state = saved(2, {"router.weight": router, "experts.gate_up_proj": torch.cat([gate, up], 1),
                      "experts.down_proj": down})
    for e in range(E):
        for name, want in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
            key = f"experts.{e}.{name}.weight"
            assert torch.equal(state[key], want), f"{key} does not hold expert {e}'s {name}"
    fused_e2fh = torch.stack([torch.cat([state[f"experts.{e}.gate_proj.weight"],
                                         state[f"experts.{e}.up_proj.weight"]]) for e in range(E)])
    down_ehf = torch.stack([state[f"experts.{e}.down_proj.weight"] for e in range(E)])
    for gate_up_name, down_name in (("gate_up_proj", "down_proj"), ("w13", "w2")):
        again = saved(4, {"router.weight": router, f"experts.{gate_up_name}": fused_e2fh,
                          f"experts.{down_name}": down_ehf})
        assert again.keys() == state.keys()
        assert all(torch.equal(again[k], state[k]) for k in state), gate_up_name


@pytest.mark.parametrize("layout", ["fused", "fused_transposed", "w13", "per_expert", "mixtral"])
def test_checkpoint_layouts_load_to_the_same_model(layout):
    fused = full_checkpoint(seed=2)
    state = {
        "fused": fused,
        "fused_transposed": {**fused, "experts.gate_up_proj": fused["experts.gate_up_proj"].transpose(1, 2)},
        "w13": {"router.weight": fused["router.weight"], "experts.w13": fused["experts.gate_up_proj"],
                "experts.w2": fused["experts.down_proj"]},
        "per_expert": per_expert(fused),
        "mixtral": per_expert(fused, ("w1", "w3", "w2")),
    }[layout]
    tokens = torch.randn(16, H, generator=torch.Generator().manual_seed(3), dtype=F64)
    torch.testing.assert_close(forward_all(2, state, tokens), forward_all(2, fused, tokens), **TOL)


def test_missing_and_misshapen_experts_are_reported():
    layer = MoonEPMoELayer(config(1))
    state = per_expert(full_checkpoint(seed=4))
    del state["experts.3.up_proj.weight"]
    result = layer.load_state_dict(state, strict=False)
    assert result.missing_keys == ["experts.3.up_proj.weight"]
    state["experts.3.up_proj.weight"] = torch.zeros(F + 1, H, dtype=F64)
    with pytest.raises(RuntimeError, match=r"experts.3.up_proj.weight: expected \[6, 8\], got \[7, 8\] "
                                           r"\(rank 0\)"):
        layer.load_state_dict(state)


def load_on_two_ranks(state: dict[str, torch.Tensor], **overrides) -> list[str | MoonEPMoELayer]:
    """`state` loaded on each of 2 ranks (experts 0-7 on rank 0, 8-15 on rank 1): the rank's layer, or the
    message its `load_state_dict` raised."""

    def rank_fn(world):
        layer = MoonEPMoELayer(config(2).model_copy(update=overrides), world)
        try:
            layer.load_state_dict(state)
        except RuntimeError as error:
            return str(error)
        return layer

    return run_ranks(rank_fn, 2)


def test_a_misshapen_expert_is_reported_by_the_rank_that_loads_it():
    state = per_expert(full_checkpoint(seed=5))
    state["experts.9.down_proj.weight"] = torch.zeros(H, F + 1, dtype=F64)
    loaded, message = load_on_two_ranks(state)
    assert isinstance(loaded, MoonEPMoELayer)
    assert "experts.9.down_proj.weight: expected [8, 6], got [8, 7] (rank 1)" in message


NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


@pytest.mark.parametrize("layout, value", [(layout, value) for layout in ("per_expert", "fused")
                                           for value in NON_FINITE] + [("per_expert_fp8", "nan")])
def test_non_finite_expert_weights_are_refused_naming_the_key_the_expert_and_the_rank(layout, value):
    """NaN or Inf in one expert's weights (expert 9: rank 1's) is a load error on the rank that loads it;
    the other rank loads. FP8 weights (DeepSeek-V3's per-expert e4m3 + scales; e4m3 has NaN, no Inf) are
    checked as stored."""
    fused = full_checkpoint(seed=6)
    fused["experts.down_proj"][9, 2, 3] = NON_FINITE[value]
    state = per_expert(fused) if layout != "fused" else fused
    key = "experts.down_proj" if layout == "fused" else "experts.9.down_proj.weight"
    if layout == "per_expert_fp8":
        state[key] = state[key].to(torch.float8_e4m3fn)
        state[f"{key}_scale_inv"] = torch.ones(1, 1)
    loaded, message = load_on_two_ranks(state)
    assert isinstance(loaded, MoonEPMoELayer)
    assert (f"{key}: expert 9's weights hold NaN or Inf (rank 1); MoEConfig.allow_non_finite_weights=True "
            "loads them as stored") in message


def test_non_finite_expert_weights_load_as_stored_when_allowed():
    fused = full_checkpoint(seed=7)
    fused["experts.gate_up_proj"][12, 0, 0] = float("nan")
    fused["experts.down_proj"][9, 2, 3] = float("inf")
    _, layer = load_on_two_ranks(fused, allow_non_finite_weights=True)
    assert torch.isnan(layer.experts.gate_up[4, 0, 0]) and torch.isinf(layer.experts.down[1, 2, 3])
    torch.testing.assert_close(layer.experts.down[0], fused["experts.down_proj"][8], **TOL)


def test_layers_of_one_shape_share_one_slot_pool_that_optimizers_never_see():
    def rank_fn(world):
        first, second = MoonEPMoELayer(config(2), world), MoonEPMoELayer(config(2), world)
        optimizer = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1)
        pooled, theirs = ([rows.slots.local for rows in layer.experts.rows]
                          + [grads.local for grads in layer.experts.slot_grads] for layer in (first, second))
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return ([a is b for a, b in zip(pooled, theirs, strict=True)],
                any(id(t) in optimized for t in pooled), pooled[0].shape)

    for shared, seen, shape in run_ranks(rank_fn, 2):
        assert all(shared) and not seen
        assert shape == (E // 2, 2 * F, H)  # B = epn experts per projection, not per layer


def test_stacked_layers_reprefetch_in_backward():
    """Two layers sharing the slot pool under skewed routing: the second layer's forward overwrites the
    slots the first layer used, so the first layer's backward must prefetch again to be correct."""
    R, S = 4, 16
    cfg = config(R, S)
    states = [full_checkpoint(seed=10, router_skew=3.0), full_checkpoint(seed=11, router_skew=-3.0)]
    gen = torch.Generator().manual_seed(12)
    tokens = [torch.randn(S, H, generator=gen, dtype=F64) + 1 for _ in range(R)]
    grads = [torch.randn(S, H, generator=gen, dtype=F64) for _ in range(R)]

    def rank_fn(world):
        layers = [MoonEPMoELayer(cfg, world) for _ in states]
        for layer, state in zip(layers, states, strict=True):
            layer.load_state_dict(state)
        x = tokens[world.rank].clone().requires_grad_()
        out = layers[1](layers[0](x))
        out.backward(grads[world.rank])
        used = [int(layer.balance_stats()["slots_used"].sum()) for layer in layers]
        return out.detach(), x.grad, layers[0].experts.down.grad, used

    results = run_ranks(rank_fn, R)
    assert all(u > 0 for u in results[0][3]), "both layers must use replicas for this test to mean anything"
    down_grad_0 = torch.zeros(E, H, F, dtype=F64)
    for rank in range(R):
        mid = dense_step(cfg, {"weight": states[0]["router.weight"]}, states[0]["experts.gate_up_proj"],
                         states[0]["experts.down_proj"], tokens[rank], torch.zeros(S, H, dtype=F64))["out"]
        top = dense_step(cfg, {"weight": states[1]["router.weight"]}, states[1]["experts.gate_up_proj"],
                         states[1]["experts.down_proj"], mid, grads[rank])
        bottom = dense_step(cfg, {"weight": states[0]["router.weight"]}, states[0]["experts.gate_up_proj"],
                            states[0]["experts.down_proj"], tokens[rank], top["grad_x"])
        torch.testing.assert_close(results[rank][0], top["out"], **TOL)
        torch.testing.assert_close(results[rank][1], bottom["grad_x"], **TOL)
        down_grad_0 += bottom["grad_down"]
    torch.testing.assert_close(torch.cat([r[2] for r in results]), down_grad_0, **TOL)


def test_compute_weights_without_slots_is_the_home_tensor_itself():
    """B = 0 (EP = 1): the grouped GEMM gets the home experts as one tensor (no per-call copy); with slots
    (no arena on the CPU) it gets both parts, home first."""
    alone = MoonEPMoELayer(config(1))
    assert all(len(rows.compute_weights()) == 1 and rows.compute_weights()[0] is rows.home.local
               for rows in alone.experts.rows)

    def rank_fn(world):
        rows = MoonEPMoELayer(config(2), world).experts.rows[0]
        parts = (rows.home.local, rows.slots.local)
        return [t is part for t, part in zip(rows.compute_weights(), parts, strict=True)]

    assert all(all(same) for same in run_ranks(rank_fn, 2))


def test_a_gemm_that_wants_the_parts_gets_the_parameters_even_where_the_arena_joins_them():
    """`GroupedGemm.joined_weights = False` (the FP8 backend, which caches its casts per parameter version):
    the layer passes the home parameters themselves and the slots, never the arena's joined view; a joining
    backend gets the joined view. The arena is CUDA-only, so a stand-in joined tensor is set here."""
    from dataclasses import replace

    from moonep_moe.gemm.reference import ReferenceGroupedGemm

    class Recording(ReferenceGroupedGemm):
        def __init__(self, joined: bool):
            self.joined_weights, self.seen = joined, []

        def fwd(self, x, weights, offs_g, slots_ready=None, out=None):
            self.seen.append(tuple(weights))
            return super().fwd(x, weights, offs_g, slots_ready, out)

    def rank_fn(world):
        layer = MoonEPMoELayer(config(2), world)
        experts = layer.experts
        experts.rows = tuple(replace(rows, compute=torch.cat([rows.home.local, rows.slots.local]).detach())
                             for rows in experts.rows)
        seen = {}
        for joined in (True, False):
            layer._state.gemm = Recording(joined)
            layer(torch.randn(8, H, dtype=torch.float64))
            seen[joined] = layer._state.gemm.seen
        params = (experts.gate_up, experts.down)
        return ([weights == (rows.compute,) for weights, rows in zip(seen[True], experts.rows, strict=True)],
                [weights[0] is param and len(weights) == 2 for weights, param in zip(seen[False], params,
                                                                                      strict=True)])

    for joined_ok, parts_ok in run_ranks(rank_fn, 2):
        assert all(joined_ok) and all(parts_ok)
