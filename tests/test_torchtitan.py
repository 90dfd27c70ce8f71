"""Swapped torchtitan models against the originals (`moonep_moe.integrations.torchtitan`).

The models come from torchtitan's own registries: DeepSeek-V3 `debugmodel` (E=8, K=3, softmax scores, two
shared experts, expert bias) cut to its first 3 layers (1 dense, 2 MoE) and Qwen3 `debugmodel_moe` (E=64,
K=8, softmax with `route_norm`, no shared experts, expert bias) cut to 1 layer; some cases change the
router, or drop the shared experts or the bias, in the config before it is built. Attention is torchtitan's
causal `ScaledDotProductAttention`: the registries' flex attention needs the block masks its trainer
builds, through torch.compile.

The parity reference is the original model with one change: torchtitan's `GroupedExperts` rounds tokens
and weights to bf16 whatever the model's dtype, so the reference runs its formula (`torch._grouped_mm`)
without that rounding (`exact_experts`). The training test compares with the unchanged model.

At EP = R every rank holds a full copy of the non-expert model and runs its own batch: each rank's logits,
loss and non-expert gradients must match the original model on that batch, and the expert gradients (the
ranks' home experts, joined) the original's summed over the R batches. fp32 on the CPU, 1e-5 relative.
"""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="needs torchtitan: pip install -e '.[torchtitan]'")

from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook  # noqa: E402
from torchtitan.models import deepseek_v3, qwen3  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter  # noqa: E402

from moonep_moe import run_ranks
from moonep_moe.integrations.torchtitan import MoonEPTitanMoE, swap_moe_modules, titan_grads

# torchtitan's router asks for fp32 autocast around its gate, which CPU autocast declines (with a warning)
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")

BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
TOL = 1e-5
REGISTRIES = {  # name: (registry, flavor, layers kept)
    "deepseek_v3": (deepseek_v3.model_registry, "debugmodel", 3),
    "qwen3": (qwen3.model_registry, "debugmodel_moe", 1),
}
SIGMOID_GROUPS = dict(score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=4,
                      num_limited_groups=2)
"""DeepSeek-V3 671B's router (sigmoid scores, node-limited groups, renormalised, scaled) at debug size."""


def model_config(name: str, router: dict | None = None, shared: bool = True, bias: bool = True):
    """A registry's debug config, cut to its first layers, with SDPA attention and each MoE's router fields
    set from `router`, without shared experts (`shared=False`) or expert bias (`bias=False`)."""
    registry, flavor, layers = REGISTRIES[name]
    config = registry(flavor).model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is None:
            continue
        for key, value in (router or {}).items():
            setattr(layer.moe.router, key, value)
        if not shared:
            layer.moe.shared_experts = None
        if not bias:
            layer.moe.load_balance_coeff = None
    return config


def build(config, seed: int) -> torch.nn.Module:
    """The model of `config` initialised the torchtitan way after `torch.manual_seed(seed)`, each expert bias
    then drawn at random (`random_bias`)."""
    torch.manual_seed(seed)
    model = config.build()
    model.init_weights()
    return random_bias(model)


@torch.no_grad()
def random_bias(model: torch.nn.Module) -> torch.nn.Module:
    """Every MoE module's expert bias drawn at random, so that it moves selection."""
    for module in model.modules():
        if isinstance(module, (MoE, MoonEPTitanMoE)) and module.expert_bias_E is not None:
            module.expert_bias_E.normal_(0, 0.01)
    return model


def exact_experts(self: GroupedExperts, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor):
    """`GroupedExperts.forward` without its rounding of tokens and weights to bf16."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offsets_E)
    return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offsets_E)


def reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose experts compute in the model's dtype (`exact_experts`)."""
    ref = copy.deepcopy(model)
    for module in ref.modules():
        if isinstance(module, GroupedExperts):
            module.forward = types.MethodType(exact_experts, module)
    return ref


def batch(seed: int, vocab: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(2))


def loss_of(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = model(ids)
    return logits, cross_entropy_loss(logits, labels) / labels.numel()


def step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
         grads_of: Callable = lambda m: {n: p.grad for n, p in m.named_parameters()}) -> dict:
    """Forward + backward: logits, loss and the gradients by name (`grads_of(model)`)."""
    model.zero_grad(set_to_none=True)
    logits, loss = loss_of(model, ids, labels)
    loss.backward()
    grads = {f"grad:{n}": g.detach().clone() for n, g in grads_of(model).items()}
    return {**grads, "logits": logits.detach(), "loss": loss.detach()}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    for name, value in want.items():
        err = rel_err(got[name], value)
        assert err <= TOL, f"{what}: {name} differs, relative error {err:.2e} > {TOL:.0e}"


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy (a DTensor gathered whole: collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def is_expert(key: str) -> bool:
    return "inner_experts" in key


def swapped_steps(original: torch.nn.Module, ranks: int, batches: list) -> list[dict]:
    """Each rank's `step` on its batch, on its own copy of `original` swapped on `ranks` thread ranks (no
    world at one rank)."""
    copies = [copy.deepcopy(original) for _ in range(ranks)]

    def rank_fn(world) -> dict:
        rank = world.rank if world else 0
        model = swap_moe_modules(copies[rank], TOKENS, world, token_padding=8)
        return step(model, *batches[rank], titan_grads)

    return [rank_fn(None)] if ranks == 1 else run_ranks(rank_fn, ranks)


CASES = {  # name: (model, model_config options, EP sizes)
    "deepseek_v3": ("deepseek_v3", {}, (1, 2, 4)),
    "deepseek_v3-sigmoid-groups": ("deepseek_v3", dict(router=SIGMOID_GROUPS), (2,)),
    "deepseek_v3-no-shared-no-bias": ("deepseek_v3", dict(shared=False, bias=False), (4,)),
    "qwen3": ("qwen3", {}, (1, 4)),
    "qwen3-sigmoid-no-bias": ("qwen3", dict(router=dict(score_func="sigmoid"), bias=False), (2,)),
}


@pytest.mark.parametrize("case, ranks", [(case, r) for case, (_, _, sizes) in CASES.items() for r in sizes])
def test_swapped_model_matches_original(case, ranks):
    name, options, _ = CASES[case]
    original = build(model_config(name, **options), seed=0)
    ref = reference(original)
    batches = [batch(100 + r) for r in range(ranks)]
    want = [step(ref, *b) for b in batches]
    got = swapped_steps(original, ranks, batches)
    expert_want = {k: sum(w[k] for w in want) for k in want[0] if is_expert(k)}
    expert_got = {k: torch.cat([g[k] for g in got]) for k in expert_want}
    assert_close(expert_got, expert_want, f"{case} EP={ranks} experts")
    for rank in range(ranks):
        rest = {k: v for k, v in got[rank].items() if not is_expert(k)}
        rest_want = {k: v for k, v in want[rank].items() if not is_expert(k)}
        assert_close(rest, rest_want, f"{case} EP={ranks} rank {rank}")


def test_every_moe_module_is_swapped_with_a_config_read_from_it():
    original = build(model_config("deepseek_v3"), seed=1)
    swapped = swap_moe_modules(copy.deepcopy(original), TOKENS)
    assert [n for n, m in swapped.named_modules() if isinstance(m, MoonEPTitanMoE)] == \
        [n for n, m in original.named_modules() if isinstance(m, MoE)] == ["layers.1.moe", "layers.2.moe"]
    assert not any(isinstance(m, MoE) for m in swapped.modules())
    layer = swapped.layers["1"].moe.layer
    cfg = layer.config
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k) == (256, 256, 8, 3)
    assert cfg.shared_experts.num_shared_experts == 1 and cfg.shared_experts.ffn_hidden_size == 512
    router = cfg.router
    assert (router.score_function, router.renormalize, router.expert_bias) == ("softmax", False, True)


# -- checkpoints: torchtitan's names and layouts ------------------------------------------------------------


def test_state_dict_is_torchtitans_and_its_hf_adapter_round_trip_loads_into_the_swapped_model():
    config = model_config("deepseek_v3")
    original, other = build(config, seed=2), build(config, seed=3)
    swapped = swap_moe_modules(copy.deepcopy(original), TOKENS)
    want, got = original.state_dict(), swapped.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    adapter = DeepSeekV3StateDictAdapter(config, None)
    hf_want, hf_got = adapter.to_hf(want), adapter.to_hf(got)
    assert list(hf_got) == list(hf_want) and all(torch.equal(hf_got[k], v) for k, v in hf_want.items())
    # torchtitan's checkpointer loads with strict=False: nothing may be left out or left over
    loaded = swapped.load_state_dict(adapter.from_hf(adapter.to_hf(other.state_dict())), strict=False)
    assert (loaded.missing_keys, loaded.unexpected_keys) == ([], [])
    ids, _ = batch(7)
    with torch.no_grad():
        assert rel_err(swapped(ids), reference(other)(ids)) <= TOL
    partial = {k: v for k, v in want.items() if not k.endswith(("w2_EDF", "router.gate.weight"))}
    missing = swapped.load_state_dict(partial, strict=False).missing_keys
    assert sorted(missing) == [f"layers.{i}.moe.{name}" for i in (1, 2)
                               for name in ("routed_experts.inner_experts.w2_EDF", "router.gate.weight")]


def test_expert_tensors_of_another_count_are_a_load_error_naming_the_key_and_the_rank():
    config = model_config("deepseek_v3")
    copies = [build(config, seed=2) for _ in range(2)]

    def rank_fn(world) -> tuple[str, str]:
        model = swap_moe_modules(copies[world.rank], TOKENS, world)
        state = model.state_dict()
        key = next(k for k in state if is_expert(k))
        with pytest.raises(RuntimeError) as error:
            model.load_state_dict({**state, key: state[key][:3]})
        return key, str(error.value)

    for rank, (key, message) in enumerate(run_ranks(rank_fn, 2)):
        assert f"{key}: expected 8 experts (the whole layer) or this rank's 4, got 3 (rank {rank})" in message


def test_state_dict_at_ep2_holds_home_experts_and_whole_or_home_checkpoints_load():
    config = model_config("deepseek_v3")
    original, other = build(config, seed=2), build(config, seed=3)
    copies = [copy.deepcopy(original) for _ in range(2)]

    def rank_fn(world) -> tuple[dict, dict, dict]:
        model = swap_moe_modules(copies[world.rank], TOKENS, world)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(other.state_dict())  # whole [E, ...] experts
        whole = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(saved)  # this rank's [epn, ...]
        return saved, whole, model.state_dict()

    results = run_ranks(rank_fn, 2)
    for index, source in ((0, original), (1, other), (2, original)):
        states = [result[index] for result in results]
        for key, value in source.state_dict().items():
            if is_expert(key):
                assert [s[key].shape[0] for s in states] == [4, 4], key
                assert torch.equal(torch.cat([s[key] for s in states]), value), key
            else:
                assert all(torch.equal(s[key], value) for s in states), key


# -- built on meta, initialised the torchtitan way ----------------------------------------------------------


INIT_LOCK = threading.Lock()
"""Thread ranks share torch's one default generator: each seeds and initialises under this lock, so that
every rank draws what a process of its own would (initialising is local: no collective inside). Without it
the ranks' draws for the shared experts and the rest interleave, differently from run to run."""


def materialised(config, world, seed: int = 4) -> dict[str, torch.Tensor]:
    """`config` built on meta, swapped on `world`, then `to_empty()` and torchtitan's `init_weights()` from
    `seed`: the MoE modules' state (after a forward, which must run)."""
    with torch.device("meta"):
        model = config.build()
    swap_moe_modules(model, TOKENS, world)
    model.to_empty(device="cpu")
    with INIT_LOCK:
        torch.manual_seed(seed)
        model.init_weights()
    with torch.no_grad():
        model(batch(8)[0])
    return {k: v.clone() for k, v in model.state_dict().items() if ".moe." in k}


def test_a_meta_built_swapped_model_initialises_with_torchtitans_initialisers_the_same_at_every_ep_size():
    """The MoE layer of a two-layer model, built on meta and initialised from one seed on one rank and on two
    thread ranks: the same weights (experts split by rank, the rest on every rank)."""
    config = model_config("deepseek_v3")
    config.layers = config.layers[:2]
    torch.manual_seed(4)  # the layer's init seed: drawn at construction, rank 0's draw on every rank
    one = materialised(config, None)
    torch.manual_seed(4)
    two = run_ranks(lambda world: materialised(config, world), 2)
    for key, value in one.items():
        got = torch.cat([t[key] for t in two]) if is_expert(key) else two[0][key]
        assert torch.equal(got, value), key
        if not is_expert(key):
            assert torch.equal(two[1][key], value), key
    w1 = one["layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    assert abs(float(w1.std()) / 0.02 - 1) < 0.02, "w1_EFD: torchtitan's trunc_normal_(std=0.02)"
    assert not torch.equal(w1[0], w1[1]), "each expert drawn apart"
    assert torch.equal(one["layers.1.moe.expert_bias_E"], torch.zeros(8))


# -- aux-loss-free balancing: torchtitan's hook on the global loads -----------------------------------------


class NoLossMesh:
    """torchtitan's `ParallelDims` as its balancing hook reads it, for one process: no EP, no TP, no "loss"
    mesh to sum the counts over (thread ranks each hold the EP group's counts already)."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, dims) -> None:
        return None


def balanced_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                  parallel_dims=None, before_step: Callable = lambda: None) -> dict:
    """Forward + backward, `before_step()`, then torchtitan's optimizer with its balancing hook
    (`parallel_dims` default `NoLossMesh`): the gradients (whole), the counts the hook read and the
    expert biases it left."""
    optimizers = default_adamw(lr=1e-3, fused=False).build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims or NoLossMesh())
    model.train()
    loss_of(model, ids, labels)[1].backward()
    before_step()
    grads = {f"grad:{k}": full(v) for k, v in titan_grads(model).items()}
    moes = [m for m in model.modules() if isinstance(m, (MoE, MoonEPTitanMoE))]
    counts = [m.tokens_per_expert_E.clone() for m in moes]
    optimizers.step()
    assert all(not m.tokens_per_expert_E.any() for m in moes), "the hook zeroes the counts"
    return {"grads": grads, "counts": counts, "bias": [m.expert_bias_E.clone() for m in moes]}


@pytest.mark.parametrize("ranks, checkpointed", [(2, False), (1, True)],
                         ids=["ep2", "ep1-activation-checkpointing"])
def test_torchtitans_balancing_hook_moves_the_bias_by_the_global_loads(ranks, checkpointed):
    """At EP=2 each rank runs half of the global batch and counts the whole group's routes; under
    torchtitan's (non-reentrant) activation checkpointing the recompute counts again, as torchtitan's own
    MoE does, and the hook halves them. Either way the bias moves as the original's on the global batch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    original = build(model_config("deepseek_v3"), seed=5)
    ids, labels = (torch.cat(parts) for parts in zip(batch(9), batch(10), strict=True))
    want = balanced_step(reference(original), ids, labels)
    copies = [copy.deepcopy(original) for _ in range(ranks)]

    def rank_fn(world) -> dict:
        rank = world.rank if world else 0
        model = swap_moe_modules(copies[rank], 2 * TOKENS // ranks, world)
        if checkpointed:
            for key, block in model.layers.items():
                model.layers[key] = checkpoint_wrapper(block)
        share = slice(rank * 2 * BATCH // ranks, (rank + 1) * 2 * BATCH // ranks)
        return balanced_step(model, ids[share], labels[share])

    got = [rank_fn(None)] if ranks == 1 else run_ranks(rank_fn, ranks)
    for rank, result in enumerate(got):
        for layer, (count, bias) in enumerate(zip(result["counts"], result["bias"], strict=True)):
            assert torch.equal(count, want["counts"][layer] * (2 if checkpointed else 1)), (rank, layer)
            assert torch.equal(bias, want["bias"][layer]), (rank, layer)
    assert not torch.equal(want["bias"][0], original.layers["1"].moe.expert_bias_E), "the bias moved"


# -- what is refused ----------------------------------------------------------------------------------------


def refused(change: Callable, overrides: dict | None = None) -> str:
    """The error of swapping a one-MoE-layer DeepSeek-V3 after `change(model's MoE)`."""
    config = model_config("deepseek_v3")
    config.layers = config.layers[:2]
    model = build(config, seed=0)  # initialised, so only `change` can make the swap refuse
    change(model.layers["1"].moe)
    with pytest.raises(ValueError) as error:
        swap_moe_modules(model, TOKENS, **(overrides or {}))
    return str(error.value)


def set_attrs(target_of: Callable, **values) -> Callable:
    return lambda moe: [setattr(target_of(moe), k, v) for k, v in values.items()]


class ConvertedExperts(GroupedExperts):
    """What a low-precision converter swaps in: a subclass with its own GEMMs."""


class OtherDispatcher:
    """A token dispatcher of another `moe_comm_backend` (DeepEP's, HybridEP's: they build on CUDA only)."""


@pytest.mark.parametrize("change, overrides, message", [
    (set_attrs(lambda m: m.router, num_expert_groups=4, num_limited_groups=2), None,
     "layers.1.moe.router: num_expert_groups=4 with score_func='softmax' is not supported"),
    (set_attrs(lambda m: m.router, score_func="sigmoid", num_expert_groups=4), None,
     "layers.1.moe.router: num_expert_groups=4 needs num_limited_groups; got None"),
    (set_attrs(lambda m: m.router, _debug_force_load_balance=True), None,
     "layers.1.moe.router: _debug_force_load_balance=True is not supported"),
    (lambda m: setattr(m.router.gate, "bias", torch.nn.Parameter(torch.zeros(8))), None,
     "layers.1.moe.router.gate: bias=True is not supported"),
    (lambda m: setattr(m.shared_experts.w2, "bias", torch.nn.Parameter(torch.zeros(256))), None,
     "layers.1.moe.shared_experts.w2: bias=True is not supported"),
    (set_attrs(lambda m: m.routed_experts.inner_experts, __class__=ConvertedExperts), None,
     "layers.1.moe.routed_experts.inner_experts: ConvertedExperts is not supported; expected GroupedExperts"),
    (set_attrs(lambda m: m.routed_experts, token_dispatcher=OtherDispatcher()), None,
     "layers.1.moe: moe_comm_backend with OtherDispatcher is not supported; expected 'standard'"),
    (set_attrs(lambda m: m.routed_experts.token_dispatcher, ep_mesh="mesh"), None,
     "layers.1.moe is already parallelized by torchtitan"),
    (lambda m: None, dict(router={"aux_loss_coeff": 0.01}),
     "router.aux_loss_coeff must stay 0 in a swapped torchtitan module"),
], ids=["softmax-groups", "groups-without-limit", "forced-balance", "gate-bias", "shared-bias", "converted",
        "comm-backend", "torchtitan-ep", "aux-loss"])
def test_what_cannot_be_reproduced_is_refused_naming_the_argument(change, overrides, message):
    assert refused(change, overrides).startswith(message)


def test_torchtitans_own_parallelisms_on_a_swapped_module_are_refused():
    # initialised: `build()` alone leaves torch.empty weights, whose garbage may hold NaN (refused)
    model = swap_moe_modules(build(model_config("deepseek_v3"), seed=0), TOKENS)
    moe = model.layers["1"].moe
    for dims, name in ((types.SimpleNamespace(ep=2, tp=1), "expert_parallel_degree=2"),
                       (types.SimpleNamespace(ep=1, tp=2), "tensor_parallel_degree=2")):
        with pytest.raises(ValueError, match=f"^{name} is not supported on a MoonEP MoE module"):
            moe.parallelize(dims)
    with pytest.raises(ValueError, match=r"^torchtitan's FSDP or expert-parallel application"):
        moe.routed_experts  # what torchtitan's apply_fsdp_to_decoder reads first  # noqa: B018
    with pytest.raises(ValueError, match="^no torchtitan MoE module in Qwen3Model"):
        dense = qwen3.model_registry("debugmodel").model
        dense.layers = dense.layers[:1]
        swap_moe_modules(dense.build(), TOKENS)


# -- data parallelism: FSDP2 over DP 2 x EP 2 gloo processes ------------------------------------------------

DP, EP = 2, 2


class LossMesh(NoLossMesh):
    """torchtitan's `ParallelDims` as its balancing hook reads it, with `mesh` as its "loss" mesh (every
    data-parallel rank; with MoonEP's EP, every rank of the mesh)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def get_optional_mesh(self, dims):
        return self.mesh if dims == "loss" else None


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The step's `[DP * EP * BATCH, SEQ]` tokens and labels; rank g takes rows
    `[g * BATCH, (g + 1) * BATCH)`."""
    return tuple(torch.cat(parts) for parts in zip(*(batch(200 + g) for g in range(DP * EP)), strict=True))


def meta_swapped(world, tokens: int) -> torch.nn.Module:
    """The flow of docs/torchtitan.md: DeepSeek-V3's debug model (3 layers) built on meta after
    `torch.manual_seed(11)`, swapped on `world`, then `to_empty()` and torchtitan's `init_weights()`; the
    expert biases drawn at random after."""
    torch.manual_seed(11)
    with torch.device("meta"):
        model = model_config("deepseek_v3").build()
    swap_moe_modules(model, tokens, world)
    model.to_empty(device="cpu")
    model.init_weights()
    return random_bias(model)


def fsdp_job(world) -> dict:
    """One rank of DP x EP gloo processes: the swapped model (`meta_swapped`) on the ("dp", "ep") mesh's EP
    world, its blocks and itself under FSDP2 (`data_parallel(..., "fsdp")`); its state dict (whole tensors),
    saved and loaded back, then one step on its rows of the global batch: the reduced gradients (whole),
    and the expert biases after torchtitan's optimizer with its balancing hook over the whole mesh."""
    from moonep_moe.parallel import data_parallel, mesh_dims, moe_mesh, reduce_expert_grads

    torch.set_num_threads(1)
    mesh = moe_mesh(DP, EP)
    model = meta_swapped(mesh, TOKENS)
    model = data_parallel(model, mesh, "fsdp", blocks=list(model.layers.values()))
    state = {k: full(v) for k, v in model.state_dict().items()}
    model.load_state_dict(model.state_dict())
    reloaded = {k: full(v) for k, v in model.state_dict().items()}
    rank = mesh.get_rank()
    ids, labels = (t[rank * BATCH:(rank + 1) * BATCH] for t in global_batch())
    result = balanced_step(model, ids, labels, LossMesh(mesh_dims(mesh)["all"]),
                           before_step=lambda: reduce_expert_grads(model, mesh))
    return {"state": state, "reloaded": reloaded, **result}


def test_fsdp2_dp2_ep2_processes_have_the_state_gradients_and_bias_of_one_process_on_the_global_batch(
        tmp_path):
    """torchtitan's own FSDP application (`parallelize_fn`) would shard the home experts (refused above):
    FSDP2 is `moonep_moe.parallel.data_parallel`'s, over all 4 ranks, with the home experts left out and
    reduced over "dp" by `reduce_expert_grads`. The reference is one process with the same swapped model
    (built the same way, at EP 1) on the global batch: the same initial state (every tensor whole), the
    gradients within 1e-5 (fp32 sums in another order), and the biases exactly, as the hook's sums over the
    4 ranks scale every count alike."""
    from processes import spawn_ranks
    from test_collective import RUN_TIMEOUT_S, rank_main

    one = meta_swapped(None, DP * EP * TOKENS)
    want_state = {k: v.clone() for k, v in one.state_dict().items()}
    want = balanced_step(one, *global_batch())
    results = spawn_ranks(rank_main, fsdp_job, DP * EP, tmp_path, RUN_TIMEOUT_S)
    for rank, result in enumerate(results):
        assert_close(result["grads"], want["grads"], f"DP {DP} x EP {EP}, rank {rank}")
        for state in (result["state"], result["reloaded"]):
            assert list(state) == list(want_state)
            assert all(torch.equal(state[k], v) for k, v in want_state.items()), rank
        biases = zip(result["bias"], want["bias"], strict=True)
        assert all(torch.equal(got, bias) for got, bias in biases), f"rank {rank}: expert bias"


# -- training: torchtitan's loop components, 50 steps -------------------------------------------------------


def test_fifty_training_steps_with_torchtitans_components_follow_the_unswapped_loss_curve(tmp_path):
    """`python -m bench.torchtitan_train --smoke`: torchtitan's loss, AdamW, schedule and balancing hook
    train DeepSeek-V3's debug model (cut to 1 dense and 1 MoE layer) and its swapped copy for 50 steps in
    fp32 on the CPU; the original unchanged (its experts in bf16). Every step's loss within 2%, the loss
    falling, and the record written with both curves and the MoE timings."""
    from bench.torchtitan_train import main

    record = main(["--smoke", "--out", str(tmp_path)])
    (original, swapped), = [record["results"]]
    assert (original["model"], swapped["model"]) == ("torchtitan", "moonep")
    assert len(original["losses"]) == len(swapped["losses"]) == 50
    for step_index, (got, want) in enumerate(zip(swapped["losses"], original["losses"], strict=True)):
        assert abs(got - want) <= 0.02 * abs(want), f"step {step_index}: loss {got} against {want}"
    assert swapped["losses"][-1] < 0.5 * swapped["losses"][0]
    assert record["checks"][0]["pass"] and record["setup"]["moe_modules"] == 1
    (path,) = tmp_path.glob("torchtitan-train-cpu-*.json")
    assert all(key in path.read_text() for key in ("commit", "command", "moe_ms_min", "step_ms_max"))
