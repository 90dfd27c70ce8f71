"""bench/rank_replay.py: one rank of an EP group replayed alone does exactly that rank's work in the group.

Checked against a threads-world group of R ranks running the same layer step (`run_ranks`, float64 on the
CPU): every rank's grouped-GEMM outputs (its expert output rows forward, its input-gradient rows backward,
its home experts' and replicas' weight gradients) must be equal bit for bit, with the torch reference
exchange (the CPU layer's) and with the row kernels (the GPU's; Triton's interpreter here). All random
inputs are drawn on the main thread."""

from __future__ import annotations

import pytest
import torch

from bench.rank_replay import (
    PHASES,
    PeerTraffic,
    ReplayWorld,
    StandIns,
    group_step,
    incoming,
    rank_inputs,
    rank_traffic,
    replay_layer,
    replay_step,
    route_matrices,
    train_step,
)
from moonep_moe.comm.buffer import Buffer
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks

POLICIES = ("exact", "cost_aware", "off")
F64 = torch.float64
R, E, K, S, H, F = 4, 8, 3, 12, 16, 8


def config(balance: str, ranks: int = R, shared: int = 0) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_size=ranks,
                     max_tokens_per_rank=S, token_padding=4, dtype="float64", router={"dtype": "float64"},
                     balance=balance, shared_experts={"num_shared_experts": shared})


def skewed_inputs(seed: int = 0, ranks: int = R) -> dict:
    """Every rank's routes (experts 0 and 1 hot, so exact replicates them), weights, tokens, output
    gradients, and one set of expert weights per home index: expert e's weights are those of e % epn, so the
    replay's peers (which read the replaying rank's own home experts) hold the real values."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.tensor([8.0, 6.0] + [1.0] * (E - 2))
    epn = E // ranks
    return dict(topk=[torch.multinomial(popularity.expand(S, E), K, generator=gen).int()
                      for _ in range(ranks)],
                weights=[torch.rand(S, K, generator=gen, dtype=F64) for _ in range(ranks)],
                hidden=[torch.randn(S, H, generator=gen, dtype=F64) for _ in range(ranks)],
                grad_out=[torch.randn(S, H, generator=gen, dtype=F64) for _ in range(ranks)],
                gate_up=torch.randn(epn, 2 * F, H, generator=gen, dtype=F64) / H**0.5,
                down=torch.randn(epn, H, F, generator=gen, dtype=F64) / F**0.5)


class RecordingGemm:
    """The layer's GEMM backend, keeping a copy of every output: forward and dgrad rows (the rows the plan
    fills), wgrad parts (home experts' gradients, replicas' gradients)."""

    def __init__(self, inner):
        self.inner, self.outputs = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fwd(self, x, weights, offs_g, slots_ready=None, out=None):
        y = self.inner.fwd(x, weights, offs_g, slots_ready, out)
        self.outputs.append(("fwd", y[:int(offs_g[-1])].clone()))
        return y

    def dgrad(self, dy, weights, offs_g, slots_ready=None, out=None):
        dx = self.inner.dgrad(dy, weights, offs_g, slots_ready, out)
        self.outputs.append(("dgrad", dx[:int(offs_g[-1])].clone()))
        return dx

    def wgrad(self, dy, x, offs_g, out, accumulate=True):
        parts = self.inner.wgrad(dy, x, offs_g, out, accumulate)
        self.outputs += [("wgrad", part.clone()) for part in parts]
        return parts


def prepared(layer: MoonEPMoELayer, inputs: dict) -> RecordingGemm:
    """The layer with the problem's experts (and shared experts, where it has them: the same on every
    rank) and a recording GEMM backend (which it returns)."""
    with torch.no_grad():
        layer.experts.gate_up.copy_(inputs["gate_up"])
        layer.experts.down.copy_(inputs["down"])
        if layer.shared_experts is not None:
            gen = torch.Generator().manual_seed(7)
            for weight in layer.shared_experts.parameters():
                weight.copy_(torch.randn(weight.shape, generator=gen, dtype=F64) / weight.shape[1]**0.5)
    layer._state.gemm = recorder = RecordingGemm(layer._state.gemm)
    return recorder


def group_outputs(cfg: MoEConfig, step, inputs: dict) -> list[list]:
    """Every rank's GEMM outputs in a threads-world group running the same step."""
    def rank_fn(world):
        layer = MoonEPMoELayer(cfg, world)
        recorder = prepared(layer, inputs)
        train_step(layer, rank_inputs(step, world.rank))
        return recorder.outputs

    return run_ranks(rank_fn, cfg.ep_size)


def replayed_outputs(cfg: MoEConfig, step, inputs: dict, rank: int, kernels: bool = False,
                     traffic_edit=None) -> tuple[list, ReplayWorld]:
    """Rank `rank`'s GEMM outputs replayed alone (`bench.rank_replay`); `kernels`: its Buffer runs the row
    kernels (Triton's interpreter on the CPU); `traffic_edit(traffic)` may change the peers' traffic."""
    layer, world = replay_layer(cfg, rank, StandIns(), "cpu")
    recorder = prepared(layer, inputs)
    if kernels:
        layer.buffer.destroy()
        layer.buffer = layer._state.buffer = Buffer(
            S, H, K, E, cfg.ep_size, B=cfg.prefetch_slots, token_padding=cfg.token_padding, world=world,
            dtype=F64, validate=False, replica_cost=cfg.replica_cost, kernels=True)
    traffic = rank_traffic(step, rank, layer, world)
    if traffic_edit is not None:
        traffic_edit(traffic)
    replay_step(layer, world, step, rank_inputs(step, rank), traffic)
    return recorder.outputs, world


def assert_same_work(mine: list, theirs: list, what: str) -> None:
    assert [kind for kind, _ in mine] == [kind for kind, _ in theirs], what
    assert [kind for kind, _ in mine] == ["fwd", "fwd", "dgrad", "wgrad", "wgrad", "dgrad", "wgrad", "wgrad"]
    for i, ((kind, a), (_, b)) in enumerate(zip(mine, theirs, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: output {i} ({kind}) differs"


@pytest.mark.parametrize("balance", POLICIES)
def test_each_rank_replayed_alone_does_its_work_in_the_group_bit_for_bit(balance):
    inputs = skewed_inputs()
    cfg = config(balance)
    step = group_step(cfg, inputs["topk"], inputs["weights"], inputs["hidden"], inputs["grad_out"])
    theirs = group_outputs(cfg, step, inputs)
    for rank in range(R):
        mine, _ = replayed_outputs(cfg, step, inputs, rank)
        assert_same_work(mine, theirs[rank], f"{balance}, rank {rank}")
    if balance == "exact":  # the skew makes exact replicate: some rank's slots hold rows
        assert int(step.plans[0].slots_used.sum()) > 0


def test_a_replayed_rank_with_shared_experts_does_its_work_in_the_group_bit_for_bit():
    """`bench.ep_group --shared-experts`: the replayed step runs the layer's expert step (`experts_step`),
    the shared experts with the routed ones: each rank's routed GEMM outputs and its shared experts' weight
    gradients (its own tokens' work) equal what that rank computes in a threads-world group."""
    inputs = skewed_inputs()
    cfg = config("exact", shared=1)
    step = group_step(cfg, inputs["topk"], inputs["weights"], inputs["hidden"], inputs["grad_out"])

    def shared_grads(layer: MoonEPMoELayer) -> list[torch.Tensor]:
        return [weight.grad.clone() for weight in layer.shared_experts.parameters()]

    def rank_fn(world):
        layer = MoonEPMoELayer(cfg, world)
        recorder = prepared(layer, inputs)
        train_step(layer, rank_inputs(step, world.rank))
        return recorder.outputs, shared_grads(layer)

    group = run_ranks(rank_fn, R)
    for rank in range(R):
        layer, world = replay_layer(cfg, rank, StandIns(), "cpu")
        recorder = prepared(layer, inputs)
        replay_step(layer, world, step, rank_inputs(step, rank), rank_traffic(step, rank, layer, world))
        assert_same_work(recorder.outputs, group[rank][0], f"rank {rank}")
        for i, (mine, theirs) in enumerate(zip(shared_grads(layer), group[rank][1], strict=True)):
            assert mine.abs().sum() > 0 and torch.equal(mine, theirs), f"rank {rank}: shared gradient {i}"


def test_the_ranks_routes_add_up_to_the_groups():
    inputs = skewed_inputs(seed=3)
    for balance in POLICIES:
        step = group_step(config(balance), inputs["topk"], inputs["weights"], inputs["hidden"],
                          inputs["grad_out"])
        counts_re = step.counts_re.cpu()
        assert int(counts_re.sum()) == R * S * K, "every route valid"
        per_expert = torch.zeros(E, dtype=torch.int64)
        for rank, plan in enumerate(step.plans):
            groups = plan.compute_groups.long().cpu()  # (end, routes, expert) of its home groups and slots
            used = groups[2] >= 0
            per_expert.index_add_(0, groups[2][used], groups[1][used])
            assert int(groups[1].sum()) == int(plan.rank_load[rank]), f"{balance}: rank {rank}'s groups"
        assert torch.equal(per_expert, counts_re.sum(0)), f"{balance}: the ranks' routes of each expert"
        assert torch.equal(route_matrices(step)["routes"].sum(1), counts_re.sum(1)), "each rank's routes sent"
        if balance == "exact":
            assert step.plans[0].rank_load.tolist() == [S * K] * R, "exact: every rank S*K routes"


def test_a_replay_without_its_peers_rows_differs():
    """The comparison can fail: a rank whose peers' rows never arrive computes other outputs."""
    inputs = skewed_inputs()
    cfg = config("exact")
    step = group_step(cfg, inputs["topk"], inputs["weights"], inputs["hidden"], inputs["grad_out"])
    theirs = group_outputs(cfg, step, inputs)

    def zero_rows(traffic):
        for t in traffic:
            if t.incoming is not None:
                t.incoming.rows[1].zero_()

    mine, _ = replayed_outputs(cfg, step, inputs, 1, traffic_edit=zero_rows)
    assert not torch.equal(mine[0][1], theirs[1][0][1]), "the forward's rows miss the peers' tokens"


@pytest.mark.interpreter
def test_the_row_kernel_exchange_replays_in_windows_bit_for_bit():
    """With the row kernels (the GPU's exchange; Triton's interpreter here) the peers' traffic runs at the
    exchange calls' barriers, one window per call of `PHASES`; every rank's work still equals the group's."""
    inputs = skewed_inputs()
    cfg = config("exact")
    step = group_step(cfg, inputs["topk"], inputs["weights"], inputs["hidden"], inputs["grad_out"])
    theirs = group_outputs(cfg, step, inputs)
    for rank in range(R):
        mine, world = replayed_outputs(cfg, step, inputs, rank, kernels=True)
        assert_same_work(mine, theirs[rank], f"row kernels, rank {rank}")
        assert [phase for phase, _ in world.window_seconds()] == list(PHASES)


def test_a_step_that_leaves_the_expected_exchange_calls_raises():
    world = ReplayWorld(0, 2, torch.device("cpu"), StandIns())
    with pytest.raises(RuntimeError, match="exchange call 0 is unexpected_call, expected send_routes"):
        with world.step([PeerTraffic()] * len(PHASES), reference_exchange=False):
            def unexpected_call():
                world.barrier()
            unexpected_call()
    with pytest.raises(RuntimeError, match="made 0 exchange calls, expected 7"):
        with world.step([PeerTraffic()] * len(PHASES), reference_exchange=False):
            pass
    world.barrier()  # outside a step: nothing to order


def test_incoming_rows_are_what_the_peers_send():
    inputs = skewed_inputs()
    step = group_step(config("off"), inputs["topk"], inputs["weights"], inputs["hidden"], inputs["grad_out"])
    payload = route_matrices(step)["payload"]
    for rank in range(R):
        forward, backward = incoming(step, rank, backward=False), incoming(step, rank, backward=True)
        received = int(payload[:, rank].sum() - payload[rank, rank])
        assert len(forward.rows[0]) == len(backward.rows[0]) == received
        assert torch.equal(forward.rows[0], backward.rows[0]), "the backward's rows land as the forward's"
        assert backward.weights is None and backward.dup_pairs is None, "weights and pairs go forward only"
    sample = incoming(step, 0, backward=False)
    rows = set(sample.rows[0].tolist())
    assert len(rows) == len(sample.rows[0]), "one writer per row"


