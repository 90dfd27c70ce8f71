"""The CUDA VMM arena: home experts and the shared slot pool as one tensor, without copies (GPU only)."""

import pytest
import torch


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
