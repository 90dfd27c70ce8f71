"""Device semantics of `MoonEPMoELayer` (DESIGN.md, "Device semantics"): the `device=` argument and torch's
default device, the meta-device build (`to_empty` + `reset_parameters`), moving a one-rank layer with its
comm memory, multi-rank layers refusing to move, identical replicated init, and pickling.

Seeds are set on the main thread before `run_ranks`: torch's default generator is shared by the rank threads.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks, single_world

F64 = torch.float64
H = 16


def make_config(R: int = 1) -> MoEConfig:
    """Every kind of parameter and buffer: router with an expert bias, home experts, gated shared experts."""
    return MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=8, top_k=2, ep_size=R,
                     max_tokens_per_rank=16, token_padding=4, dtype="float64",
                     router={"dtype": "float64", "expert_bias": True}, grouped_gemm="reference",
                     shared_experts={"num_shared_experts": 1, "gate": True})


def tokens(seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(16, H, generator=torch.Generator().manual_seed(seed), dtype=F64).to(device)


def step(layer: MoonEPMoELayer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter's gradient of one forward + backward."""
    x = x.clone().requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    grads = {f"grad/{name}": p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    return {"out": out.detach(), "grad_x": x.grad, **grads}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key].cpu(), value.cpu()), key


def on_device(layer: MoonEPMoELayer) -> set[str]:
    return {str(t.device) for t in (*layer.parameters(), *layer.buffers())}


def every_tensor(layer: MoonEPMoELayer) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer by name, the non-persistent ones (`expert_load`) too:
    `state_dict()` leaves those out."""
    return {name: t.detach().clone() for name, t in [*layer.named_parameters(), *layer.named_buffers()]}


@torch.no_grad()
def fill_with_garbage(layer: MoonEPMoELayer) -> None:
    """What `to_empty()` may leave in memory, made certain: NaN in every float tensor, a huge count in every
    integer one."""
    for tensor in [*layer.parameters(), *layer.buffers()]:
        tensor.fill_(float("nan") if tensor.is_floating_point() else 17 * 10**12)


@pytest.fixture
def set_default_device():
    yield torch.set_default_device
    torch.set_default_device(None)


def registrations(world) -> list[str]:
    """Spy on `world.symmetric`: the keys registered from now on (every comm allocation registers one)."""
    keys = []
    register = world.symmetric

    def spy(key, tensor):
        keys.append(key)
        return register(key, tensor)

    world.symmetric = spy
    return keys


# -- device= and torch's default device -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["context", "set_default_device", "argument"])
def test_layer_is_built_on_torchs_default_device_or_the_device_argument(how, set_default_device):
    if how == "context":
        with torch.device("meta"):
            layer = MoonEPMoELayer(make_config())
    elif how == "set_default_device":
        set_default_device("meta")
        layer = MoonEPMoELayer(make_config())
    else:
        layer = MoonEPMoELayer(make_config(), device="meta")
    assert on_device(layer) == {"meta"}
    assert layer.buffer is None and layer.experts.rows is None


def test_device_argument_that_contradicts_the_world_raises():
    with pytest.raises(ValueError, match=r"device=cuda:0 differs from the EP world's device cpu \(rank 0\)"):
        MoonEPMoELayer(make_config(), single_world("cpu"), device="cuda:0")


# -- meta build, to_empty, reset_parameters ---------------------------------------------------------------


def test_meta_build_allocates_no_comm_memory_and_materialises_into_the_directly_built_layer():
    torch.manual_seed(3)
    direct = MoonEPMoELayer(make_config())
    world = single_world("cpu")
    keys = registrations(world)
    torch.manual_seed(3)
    layer = MoonEPMoELayer(make_config(), world, device="meta")
    assert keys == [] and layer.buffer is None and layer.experts.rows is None
    assert not any(isinstance(key, tuple) and key[0] in ("slots", "slot_grads") for key in world.globals)
    layer.to_empty(device="cpu")
    assert {"buffer0/rows", "moe0/gate_up", "moe0/down"} <= set(keys)
    fill_with_garbage(layer)
    layer.reset_parameters()
    assert on_device(layer) == {"cpu"}
    assert "expert_load" in every_tensor(layer) and "expert_load" not in layer.state_dict()
    assert_same(every_tensor(layer), every_tensor(direct))
    assert_same(step(layer, tokens(4)), step(direct, tokens(4)))


def test_multi_rank_meta_build_materialises_on_the_worlds_device():
    cfg = make_config(R=2)

    def direct(world):
        layer = MoonEPMoELayer(cfg, world)
        return every_tensor(layer), step(layer, tokens(5 + world.rank))

    def via_meta(world):
        with torch.device("meta"):
            layer = MoonEPMoELayer(cfg, world)
        assert layer.buffer is None
        layer.to_empty(device=world.device)
        fill_with_garbage(layer)
        layer.reset_parameters()
        return every_tensor(layer), step(layer, tokens(5 + world.rank))

    torch.manual_seed(6)
    want = run_ranks(direct, 2)
    torch.manual_seed(6)
    got = run_ranks(via_meta, 2)
    for (got_state, got_step), (want_state, want_step) in zip(got, want, strict=True):
        assert_same(got_state, want_state)
        assert_same(got_step, want_step)


def test_forward_on_meta_or_with_input_on_another_device_raises():
    with pytest.raises(RuntimeError, match=r"meta device \(rank 0\).*to_empty"):
        MoonEPMoELayer(make_config(), device="meta")(tokens(1))
    with pytest.raises(ValueError, match=r"hidden_states must be on cpu \(the layer's device\), got meta"):
        MoonEPMoELayer(make_config())(tokens(1).to("meta"))


# -- moving -----------------------------------------------------------------------------------------------


def test_one_rank_layer_moves_with_its_comm_memory():
    """`.to()` to where it is keeps everything; to meta releases the comm memory; `to_empty` back allocates
    it again (registered anew, so a storage change is followed too) and the layer runs as before."""
    layer = MoonEPMoELayer(make_config())
    want = step(layer, tokens(2))
    buffer = layer.buffer
    assert layer.to("cpu", F64) is layer and layer.buffer is buffer
    layer.to("meta")
    assert on_device(layer) == {"meta"} and layer.buffer is None and layer.experts.rows is None
    assert buffer.destroyed
    layer.to_empty(device="cpu").reset_parameters()
    assert_same(step(layer, tokens(2)), want)
    saved = copy.deepcopy(layer.state_dict())
    layer.to_empty(device="cpu")  # same device, new storage: the comm memory follows it
    layer.load_state_dict(saved)
    assert_same(step(layer, tokens(2)), want)


def test_layers_that_shared_a_one_rank_world_share_it_after_a_move():
    world = single_world("cpu")
    layers = [MoonEPMoELayer(make_config(), world) for _ in range(2)]
    for layer in layers:
        layer.to("meta")
    assert layers[0].world is layers[1].world and layers[0].world.device.type == "meta"
    for layer in layers:
        layer.to_empty(device="cpu").reset_parameters()
        assert layer.world is world and step(layer, tokens(6))["out"].isfinite().all()


def test_dtype_conversion_against_the_config_raises_and_changes_nothing():
    layer = MoonEPMoELayer(make_config())
    with pytest.raises(ValueError, match=r"cannot convert .*float64 parameters to torch.float32 \(rank 0\)"):
        layer.float()
    assert {p.dtype for p in layer.parameters()} == {F64}
    assert step(layer, tokens(3))["out"].dtype == F64


def test_multi_rank_layer_refuses_to_move_and_stays_usable():
    cfg = make_config(R=2)

    def rank_fn(world):
        layer = MoonEPMoELayer(cfg, world)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        errors = []
        for move in (lambda: layer.to("meta"), lambda: layer.to_empty(device="meta")):
            with pytest.raises(ValueError) as error:
                move()
            errors.append(str(error.value))
        assert_same(layer.state_dict(), before)
        return errors, step(layer, tokens(7 + world.rank))["out"]

    for rank, (errors, out) in enumerate(run_ranks(rank_fn, 2)):
        for error in errors:
            assert (f"cannot move a 2-rank MoonEPMoELayer to meta (rank {rank}): it is bound to its EP "
                    "world's device cpu") in error
        assert out.isfinite().all()


@pytest.mark.gpu
def test_cuda_one_rank_layer_moves_between_cpu_and_cuda():
    """Float64 with the reference GEMM: the same numbers on either device, within rounding."""
    layer = MoonEPMoELayer(make_config())
    want = step(layer, tokens(8))
    layer.cuda()
    assert on_device(layer) == {"cuda:0"} and layer.world.device == torch.device("cuda", 0)
    assert layer.buffer.hidden_nvsh_buffer_view.device.type == "cuda"
    got = step(layer, tokens(8, "cuda"))
    for key, value in want.items():
        torch.testing.assert_close(got[key].cpu(), value, rtol=1e-10, atol=1e-10, msg=key)
    layer.cpu()
    assert on_device(layer) == {"cpu"}
    assert_same(step(layer, tokens(8)), want)


@pytest.mark.gpu
def test_cuda_default_device_and_meta_to_empty_on_cuda(set_default_device):
    set_default_device("cuda")
    torch.manual_seed(9)
    direct = MoonEPMoELayer(make_config())
    set_default_device(None)
    assert on_device(direct) == {"cuda:0"}
    torch.manual_seed(9)
    layer = MoonEPMoELayer(make_config(), device="meta").to_empty(device="cuda")
    layer.reset_parameters()
    assert_same(layer.state_dict(), direct.state_dict())
    got, want = step(layer, tokens(10, "cuda")), step(direct, tokens(10, "cuda"))
    for key, value in want.items():  # CUDA float64 sums may differ in order: within rounding
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=key)


# -- initialisation ---------------------------------------------------------------------------------------


def test_replicated_parameters_start_identical_on_every_rank():
    def rank_fn(world):
        layer = MoonEPMoELayer(make_config(R=4), world)
        return {k: v for k, v in layer.state_dict().items() if not k.startswith("experts.")}

    states = run_ranks(rank_fn, 4)
    replicated = {"router.weight", "shared_experts.gate_up.weight", "shared_experts.gate.weight"}
    assert replicated <= states[0].keys()
    for state in states[1:]:
        assert_same(state, states[0])


def test_initial_model_is_the_same_at_every_ep_size_for_one_seed():
    def model(R: int, seed: int) -> dict[str, torch.Tensor]:
        """The whole model (home experts of every rank merged) built on R thread-ranks after `seed`."""
        torch.manual_seed(seed)
        states = run_ranks(lambda world: MoonEPMoELayer(make_config(R), world).state_dict(), R)
        return {k: v for state in states for k, v in state.items()}

    one = model(1, seed=11)
    assert len([k for k in one if k.startswith("experts.")]) == 3 * 8
    assert_same(model(1, seed=11), one)
    assert_same(model(2, seed=11), one)
    assert_same(model(4, seed=11), one)
    other = model(1, seed=12)
    assert not any(torch.equal(other[k], one[k]) for k in one if k.endswith("weight"))


# -- pickling ---------------------------------------------------------------------------------------------


def test_pickle_deepcopy_and_torch_save_point_to_state_dict():
    layer = MoonEPMoELayer(make_config())
    for save in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match=r"Save layer.state_dict\(\) instead"):
            save(layer)
    file = io.BytesIO()
    torch.save(layer.state_dict(), file)
    file.seek(0)
    rebuilt = MoonEPMoELayer(make_config())
    rebuilt.load_state_dict(torch.load(file))
    assert_same(step(rebuilt, tokens(12)), step(layer, tokens(12)))
