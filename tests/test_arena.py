"""The CUDA VMM arena: home experts and the shared slot pool as one tensor, without copies (GPU), and the
layer's home experts kept in their registered memory (what the arena joins and peers read) when their
storage is swapped on the same device (CPU and GPU)."""

import dataclasses

import pytest
import torch
from test_layer import F64, build_layer, make_config, make_problem, run_dense
from torch import nn

from moonep_moe.transport.threads import run_ranks


@pytest.mark.gpu
def test_joined_rows_alias_both_allocations():
    from moonep_moe.transport.arena import PhysicalRows, expert_arena_reason, joined_rows

    device = torch.device("cuda", torch.cuda.current_device())
    row_shape, dtype = (1024, 512), torch.bfloat16  # 1 MiB a row
    assert expert_arena_reason(device, [4 * 2**20, 2 * 2**20]) is None
    assert "granularity" in expert_arena_reason(device, [3 * 2**20])
    home, slots = PhysicalRows(2, row_shape, dtype, device), PhysicalRows(2, row_shape, dtype, device)
    joined = joined_rows(home, slots)
    home.tensor.copy_(torch.randn(2, *row_shape, device=device))
    slots.tensor.copy_(torch.randn(2, *row_shape, device=device))
    assert joined.shape == (4, *row_shape)
    assert torch.equal(joined, torch.cat([home.tensor, slots.tensor]))
    joined[3].fill_(7)  # writes through the joined view land in the slot allocation
    assert bool((slots.tensor[1] == 7).all())
    import gc

    gc.collect()  # the views keep their mappings alive
    assert torch.equal(joined[:2], home.tensor) and torch.equal(joined[2:], slots.tensor)


@pytest.mark.gpu
def test_scratch_rows_are_shared_by_the_tensors_of_one_key():
    """`with_scratch_rows`: each tensor's first rows are its own allocation's; its last rows are the scratch
    of its key, which every tensor of that key sees written (one allocation, the largest size asked for: a
    larger request makes a new one and leaves the earlier tensors theirs, a smaller one maps the current one),
    another key has its own."""
    import gc

    from moonep_moe.transport.arena import PhysicalRows, physical_bytes, with_scratch_rows

    device = torch.device("cuda", torch.cuda.current_device())
    mib, row_shape, dtype = 2**20, (1024, 512), torch.bfloat16  # 1 MiB a row
    gc.collect()
    before = physical_bytes(device)
    homes = [PhysicalRows(2, row_shape, dtype, device) for _ in range(2)]
    for home in homes:
        home.tensor.copy_(torch.randn(2, *row_shape, device=device))
    first, second = (with_scratch_rows(home, 2, "a") for home in homes)
    other = with_scratch_rows(homes[0], 1, "b")  # 1 MiB, rounded up to the 2 MiB granularity
    assert first.shape == (4, *row_shape) and other.shape == (3, *row_shape)
    assert physical_bytes(device) - before == (2 * 2 + 2 + 2) * mib, "two homes, one scratch per key"
    assert torch.equal(first[:2], homes[0].tensor) and torch.equal(second[:2], homes[1].tensor)
    first[2:].fill_(3)
    other[2].fill_(5)
    assert bool((second[2:] == 3).all()), "one key, one scratch"
    assert bool((first[2] == 3).all()), "another key's writes land elsewhere"
    larger = with_scratch_rows(homes[1], 4, "a")
    larger[2:].fill_(7)
    assert bool((first[2:] == 3).all()), "the earlier tensors keep the smaller scratch"
    assert physical_bytes(device) - before == (2 * 2 + 2 + 2 + 4) * mib
    smaller = with_scratch_rows(homes[0], 1, "a")  # maps the whole 4 MiB scratch (the driver maps no part)
    assert smaller.shape == (3, *row_shape) and torch.equal(smaller[:2], homes[0].tensor)
    smaller[2].fill_(9)
    assert bool((larger[2] == 9).all()) and bool((larger[3] == 7).all()), "the larger tensor's scratch"
    assert physical_bytes(device) - before == (2 * 2 + 2 + 2 + 4) * mib, "no new scratch for less"
    del first, second, other, larger, smaller, homes, home
    gc.collect()
    assert physical_bytes(device) == before


@pytest.mark.gpu
def test_physical_bytes_count_the_arena_which_the_caching_allocator_does_not():
    import gc

    from moonep_moe.transport.arena import PhysicalRows, physical_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    before, allocated = physical_bytes(device), torch.cuda.memory_allocated(device)
    rows = PhysicalRows(3, (1024, 1024), torch.bfloat16, device)  # 6 MiB
    assert physical_bytes(device) - before == 6 * 2**20 == rows.nbytes
    assert physical_bytes("cuda") == physical_bytes(device), "the current device when no index is given"
    assert torch.cuda.memory_allocated(device) == allocated, "outside the caching allocator"
    del rows
    gc.collect()
    assert physical_bytes(device) == before
    assert physical_bytes("cpu") == 0


@pytest.mark.gpu
def test_layer_arena_views_stay_coherent():
    """After a forward with replicas, the compute view still equals (home parameters, slot pool)."""
    from test_layer import build_layer, make_config, make_problem

    from moonep_moe.transport.threads import run_ranks

    cfg = make_config(2, hidden_size=1024, ffn_hidden_size=512, num_experts=8, max_tokens_per_rank=64,
                      dtype="bfloat16", grouped_gemm="torch",
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=51, skew=100.0)

    def rank_fn(world):
        layer = build_layer(p, world)
        out = layer(p.hidden[world.rank].to("cuda", torch.bfloat16))
        checks = []
        for rows, param in zip(layer.experts.rows, (layer.experts.gate_up, layer.experts.down), strict=True):
            epn = param.shape[0]
            slots = rows.slots.local
            checks.append((torch.equal(rows.compute[:epn], param), torch.equal(rows.compute[epn:], slots),
                           bool(param.isfinite().all()), bool(slots.isfinite().all())))
        return checks, bool(out.isfinite().all())

    for checks, finite in run_ranks(rank_fn, 2, device="cuda"):
        assert checks == [(True, True, True, True)] * 2 and finite, (checks, finite)


@pytest.mark.gpu
def test_layer_computes_on_the_arena_and_matches_dense():
    """Two thread-ranks on one GPU with replicas in use: the experts run on the joined [epn+B] tensors
    (no copy) and the forward matches the float64 reference within bf16 tolerance."""
    from test_layer import make_config, make_problem, run_dense, run_moonep

    cfg = make_config(2, hidden_size=1024, ffn_hidden_size=512, num_experts=8, max_tokens_per_rank=64,
                      dtype="bfloat16", grouped_gemm="torch",
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=50, skew=100.0)
    bf16 = [t.bfloat16().double() for t in p.hidden + [p.gate_up_e2fh, p.down_ehf]]
    p.hidden, p.gate_up_e2fh, p.down_ehf = bf16[:-2], bf16[-2], bf16[-1]
    got, want = run_moonep(p, "cuda", backward=False), run_dense(p)[0]
    assert all(int(g["slots_used"].sum()) > 0 for g in got)
    assert all(g["arena"] for g in got)
    for g, w in zip(got, want, strict=True):
        error = float((g["out"] - w["out"]).norm() / w["out"].norm())
        assert error < 2e-2, error


# -- storage swaps on the same device ----------------------------------------------------------------------


def swapped_problem(p):
    """`p` with new expert weights, and its tokens and weights representable in `p`'s dtype (what the layer
    computes with, so that the float64 reference sees the same values)."""
    gen = torch.Generator().manual_seed(1234)
    dtype = p.cfg.torch_dtype

    def new(t: torch.Tensor) -> torch.Tensor:
        return (torch.randn(t.shape, generator=gen, dtype=F64) * t.std()).to(dtype).double()

    return dataclasses.replace(p, hidden=[h.to(dtype).double() for h in p.hidden],
                               gate_up_e2fh=new(p.gate_up_e2fh), down_ehf=new(p.down_ehf))


def layer_state_dict(p, layer, device: str) -> dict[str, torch.Tensor]:
    """The problem's router and experts in `layer`'s checkpoint names (per expert) and dtypes."""
    f, dtype = p.cfg.ffn_hidden_size, p.cfg.torch_dtype
    router = layer.router
    state = {"router.weight": p.router_weight_eh.to(device, router.weight.dtype),
             "router.expert_bias": p.expert_bias_e.to(device, router.expert_bias.dtype)}
    for e in range(p.cfg.num_experts):
        for name, value in (("gate_proj", p.gate_up_e2fh[e, :f]), ("up_proj", p.gate_up_e2fh[e, f:]),
                            ("down_proj", p.down_ehf[e])):
            state[f"experts.{e}.{name}.weight"] = value.to(device, dtype)
    return state


def swap(layer, new, rank: int, how: str, device: str) -> None:
    """Give `layer` the home experts of problem `new` on its device: `param.data = t`, a new Parameter set
    in its place, or `load_state_dict(..., assign=True)`."""
    if how == "load_state_dict-assign":
        layer.load_state_dict(layer_state_dict(new, layer, device), assign=True)
        return
    epn = new.cfg.num_experts // new.cfg.ep_size
    home = slice(rank * epn, (rank + 1) * epn)
    for name, full in (("gate_up", new.gate_up_e2fh), ("down", new.down_ehf)):
        value = full[home].to(device, new.cfg.torch_dtype).contiguous()
        if how == "data":
            getattr(layer.experts, name).data = value
        else:
            setattr(layer.experts, name, nn.Parameter(value))


def run_swapped(p, how: str, device: str) -> list[dict]:
    """Every rank builds its layer with `p`'s experts, swaps in new ones, then runs a forward: its output,
    the slots used, and whether its compute view (the arena's, where there is one) equals the parameters."""
    new = swapped_problem(p)

    def rank_fn(world):
        layer = build_layer(p, world)
        swap(layer, new, world.rank, how, device)
        with torch.no_grad():
            out = layer(new.hidden[world.rank].to(device, p.cfg.torch_dtype))
        views = [rows.compute is None or torch.equal(rows.compute[:param.shape[0]], param)
                 for rows, param in zip(layer.experts.rows, (layer.experts.gate_up, layer.experts.down),
                                        strict=True)]
        used = layer.balance_stats()["slots_used"].cpu()
        arena = all(rows.compute is not None for rows in layer.experts.rows)
        layer.destroy()
        return dict(out=out.cpu().double(), slots_used=used, views=all(views), arena=arena)

    return run_ranks(rank_fn, p.cfg.ep_size, device=device), run_dense(new)[0]


SWAPS = ["data", "parameter", "load_state_dict-assign"]


@pytest.mark.parametrize("how", SWAPS)
def test_swapped_home_experts_are_what_the_layer_and_its_peers_compute_with(how):
    """Two thread-ranks with replicas in use: whatever the swap, this rank's GEMMs and its peers' prefetch
    compute with the new experts (a new Parameter set in place of a home expert weight is not the tensor
    registered with the world, which both read)."""
    p = make_problem(make_config(2), seed=60, skew=100.0)
    got, want = run_swapped(p, how, "cpu")
    assert all(int(g["slots_used"].sum()) > 0 for g in got)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g["out"], w["out"], rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("how", SWAPS)
def test_arena_follows_a_same_device_storage_swap(how):
    """Two thread-ranks on one GPU computing on the arena: after `param.data = t` (or a new Parameter, or an
    assigning load) on the same device, the joined compute view must hold the new experts, and the output
    match the float64 reference of the new experts within bf16 tolerance (the view maps the registered
    memory, not the swapped-in tensor)."""
    cfg = make_config(2, hidden_size=1024, ffn_hidden_size=512, num_experts=8, max_tokens_per_rank=64,
                      dtype="bfloat16", grouped_gemm="torch",
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=52, skew=100.0)
    got, want = run_swapped(p, how, "cuda")
    assert all(g["arena"] and int(g["slots_used"].sum()) > 0 for g in got)
    for g, w in zip(got, want, strict=True):
        assert g["views"], "the arena's compute view holds the parameters"
        error = float((g["out"] - w["out"]).norm() / w["out"].norm())
        assert error < 2e-2, error
