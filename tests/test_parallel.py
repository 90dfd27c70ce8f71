"""EP beside data parallelism (`moonep_moe.parallel`) with real processes: gloo on the CPU.

4 processes as a `("dp", "ep")` mesh of DP 2 x EP 2, and of DP 1 x EP 4 (EP alone), train a small float64
model (a Linear, a MoonEP layer with a gated shared expert and skewed routing, so that replicas carry
gradients, and a Linear head) under DDP and under FSDP2 (`fully_shard` of the MoE block, then of the model;
torch 2.13 runs it on the CPU with gloo), in both gradient modes, with 1 or 2 micro-batches per step. After
every step's reduction (DDP / FSDP2 for the non-expert parameters, `reduce_expert_grads` for the home
experts), every gradient must equal a single-process run's on the same global batch (one rank, all E experts,
every rank's tokens in one batch); so must the parameters after SGD steps and the expert bias moved by
`update_expert_bias`. One case runs the MoE layer under activation checkpointing (its recompute in backward
plans and exchanges again beside DDP's reductions). One zeroes with `zero_grad(set_to_none=False)` in
"main_grad" mode, so the home experts keep a `.grad` that `reduce_expert_grads` must leave alone. Three
clip the gradients by their global norm (`clip_grad_norm_`, under DDP and FSDP2, of order 2 and inf) and
must equal torch's `clip_grad_norm_` on the single process, norms included. Under
DDP and FSDP2, with and without micro-batches, `expert_load` must count this EP group's forwards only (DDP
must not broadcast it).

A home-expert gradient reduced over the wrong group ("ep", or every rank) or scaled by 1/dp instead of 1/W
fails these checks (checked by breaking `reduce_expert_grads` on purpose). One spawned run per mesh carries
every case (spawning dominates the time).

End to end, `moonep-moe train --dp 2` under torchrun (4 processes: DP 2 x EP 2, DDP) must print the loss
curve of one process training on the same global batch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from processes import spawn_ranks
from test_collective import RUN_TIMEOUT_S, rank_main
from torch import nn
from torch.utils.checkpoint import checkpoint

from moonep_moe.apps.cli import main
from moonep_moe.apps.train import sync_grads
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.parallel import (
    clip_grad_norm_,
    data_parallel,
    ep_world,
    expert_parameters,
    moe_mesh,
    reduce_expert_grads,
    update_expert_bias,
)
from moonep_moe.transport.collective import collective_world
from moonep_moe.transport.threads import run_ranks, single_world

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-12)
H, TOKENS, STEPS = 16, 12, 2
"""Hidden size, tokens per rank per step, optimizer steps per case."""

CASES = {
    "ddp": dict(strategy="ddp"),
    "fsdp2-accumulate": dict(strategy="fsdp", micro=2),
    "ddp-main_grad-accumulate-checkpointed": dict(strategy="ddp", grad_mode="main_grad", micro=2,
                                                  checkpointed=True),
    "ddp-main_grad-grads-kept-as-zeros": dict(strategy="ddp", grad_mode="main_grad", set_to_none=False),
    "ddp-accumulate-checkpointed-reduce-behind": dict(strategy="ddp", micro=2, checkpointed=True,
                                                      reduce_behind=True),
    "ddp-clipped": dict(strategy="ddp", clip=0.05),
    "fsdp2-accumulate-clipped": dict(strategy="fsdp", micro=2, clip=0.05),
    "ddp-main_grad-clipped-inf-norm": dict(strategy="ddp", grad_mode="main_grad", clip=0.01,
                                           norm_type=float("inf")),
}
"""name: `run_case`'s keywords (data-parallel strategy, expert_grad_dtype, micro-batches per step, the MoE
layer under activation checkpointing, zero_grad's set_to_none, reduce_grad behind the backward pass, the
gradients clipped to a global norm of that order)."""


def make_config(ep: int, tokens: int, grad_mode: str = "param", reduce_behind: bool = False) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=8, top_k=2, ep_size=ep,
                     max_tokens_per_rank=tokens, token_padding=4, dtype="float64", grouped_gemm="reference",
                     expert_grad_dtype=grad_mode, overlap_reduce_grad=reduce_behind,
                     router={"dtype": "float64", "expert_bias": True, "expert_bias_update_rate": 0.01},
                     shared_experts={"num_shared_experts": 1, "gate": True})


class Net(nn.Module):
    """`out(h + moe(tanh(h)))`, `h = inp(x)`: replicated Linears around one MoonEP layer."""

    def __init__(self, cfg: MoEConfig, world, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        self.inp = nn.Linear(H, H, dtype=F64)
        self.moe = MoonEPMoELayer(cfg, world)
        self.out = nn.Linear(H, 1, dtype=F64)
        with torch.no_grad():
            self.moe.router.expert_bias[:2] = 0.03  # experts 0 and 1 hot (replicas), every expert used

    def forward(self, x_th: torch.Tensor) -> torch.Tensor:
        h_th = self.inp(x_th)
        moe_th = checkpoint(self.moe, torch.tanh(h_th), use_reentrant=False) if self.checkpointed else \
            self.moe(torch.tanh(h_th))
        return self.out(h_th + moe_th)


def build(cfg: MoEConfig, world, checkpointed: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(cfg, world, checkpointed)


def global_batch(step: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s inputs `[ranks * TOKENS, H]` and targets `[ranks * TOKENS, 1]`; rank g takes block g."""
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(ranks * TOKENS, H, generator=gen, dtype=F64),
            torch.randn(ranks * TOKENS, 1, generator=gen, dtype=F64))


def expert_grad(p: nn.Parameter) -> torch.Tensor:
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU float64 copy (an FSDP2 DTensor gathered whole: collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(net: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (home experts: `.grad` or `main_grad`), or every parameter and buffer."""
    experts = set(expert_parameters(net))
    if grads:
        return {n: full(expert_grad(p) if p in experts else p.grad) for n, p in net.named_parameters()}
    return {n: full(t) for n, t in [*net.named_parameters(), *net.named_buffers()]}


def optimizer_step(net: Net, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    if net.moe.config.expert_grad_dtype == "main_grad":
        for p in expert_parameters(net):
            p.grad = p.main_grad.to(p.dtype, copy=True)  # a copy, as for bf16 weights (float64 here)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    net.moe.zero_main_grad()


def reference(ranks: int, clip: float | None = None, norm_type: float = 2.0) -> tuple[list[dict], dict, list]:
    """One process, one rank: every step on the whole global batch (its gradients clipped by torch's
    `clip_grad_norm_` with `clip`); the gradients of every step, the final parameters and buffers, and the
    total norms clipping returned."""
    net = build(make_config(1, ranks * TOKENS), single_world())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, ranks)
        nn.functional.mse_loss(net(x), y).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), clip, norm_type)))
        grads.append(snapshot(net, grads=True))
        optimizer_step(net, optimizer)
        net.moe.update_expert_bias()
    return grads, snapshot(net, grads=False), norms


# -- what runs in the spawned processes ---------------------------------------------------------------------


def run_case(dp: int, ep: int, strategy: str, grad_mode: str = "param", micro: int = 1,
             checkpointed: bool = False, set_to_none: bool = True, reduce_behind: bool = False,
             clip: float | None = None, norm_type: float = 2.0) -> dict:
    """This rank's gradients after each step's reduction (and clipping, `clip_grad_norm_`) and its final
    parameters, training `Net` on the `(dp, ep)` mesh wrapped by `strategy`, with `micro` micro-batches per
    step; the total norms clipping returned."""
    mesh = moe_mesh(dp, ep)
    net = build(make_config(ep, TOKENS, grad_mode, reduce_behind), ep_world(mesh), checkpointed)
    model = data_parallel(net, mesh, strategy, blocks=[net.moe] if strategy == "fsdp" else ())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = mesh.get_rank()
    grads, norms, slots_used = [], [], 0
    for step in range(STEPS):
        x, y = (t[rank * TOKENS:(rank + 1) * TOKENS] for t in global_batch(step, dp * ep))
        for i, (x_m, y_m) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            last = i == micro - 1
            sync = contextlib.nullcontext()
            if strategy == "ddp" and not last:
                sync = model.no_sync()
            if strategy == "fsdp":
                model.set_requires_gradient_sync(last)
            with sync:
                (nn.functional.mse_loss(model(x_m), y_m) / micro).backward()
            slots_used = max(slots_used, int(net.moe.balance_stats()["slots_used"].sum()))
        reduce_expert_grads(model, mesh)
        if clip is not None:
            norms.append(float(clip_grad_norm_(model, clip, mesh, norm_type)))
        grads.append(snapshot(net, grads=True))
        optimizer_step(net, optimizer, set_to_none)
        update_expert_bias(model, mesh)
    return {"grads": grads, "norms": norms, "state": snapshot(net, grads=False),
            "ep_rank": mesh.get_local_rank("ep"), "slots_used": slots_used}


def errors(dp: int, ep: int) -> dict[str, str]:
    """What the helpers raise: a strategy they do not know, a step without gradients, a layer built on
    another EP group than the mesh's "ep" dimension (the WORLD group's: the "ep" group itself at dp 1), and
    where dp == ep one built on a group of the right size over other ranks (this rank's "dp" column)."""
    mesh, raised = moe_mesh(dp, ep), {}
    net = build(make_config(ep, TOKENS), ep_world(mesh))
    other = build(make_config(dp * ep, TOKENS), collective_world(None))
    calls = [("strategy", lambda: data_parallel(net, mesh, "zero")),
             ("no grad", lambda: reduce_expert_grads(net, mesh)),
             ("max_norm", lambda: clip_grad_norm_(net, 0.0, mesh)),
             ("norm_type", lambda: clip_grad_norm_(net, 1.0, mesh, norm_type="2")),
             ("other group", lambda: data_parallel(other, mesh))]
    if dp == ep:
        column = build(make_config(dp, TOKENS), collective_world(mesh["dp"].get_group()))
        calls += [("other ranks", lambda: data_parallel(column, mesh)),
                  ("other ranks, reduce", lambda: reduce_expert_grads(column, mesh))]
    for name, call in calls:
        try:
            call()
        except ValueError as error:
            raised[name] = str(error)
    net.out.weight.grad = torch.full_like(net.out.weight, float("nan"))
    try:
        clip_grad_norm_(net, 1.0, mesh, error_if_nonfinite=True)
    except RuntimeError as error:
        raised["nonfinite"] = str(error)
    return raised


LOAD_MODES = {"ddp": ("ddp", 1), "ddp-accumulate": ("ddp", 2), "fsdp2-accumulate": ("fsdp", 2)}
"""name: (strategy, micro-batches per step) of `expert_load_counts`."""


def expert_load_counts(dp: int, ep: int, strategy: str, micro: int) -> list[tuple[list, list]]:
    """Per step (3, no bias update, so the counts accumulate across steps as they do without an expert bias
    or between updates): this rank's `expert_load` and the sum of its EP group's counts of every forward so
    far (`last_expert_load`, the plan's, which no wrapper sees)."""
    mesh = moe_mesh(dp, ep)
    net = build(make_config(ep, TOKENS), ep_world(mesh))
    model = data_parallel(net, mesh, strategy, blocks=[net.moe] if strategy == "fsdp" else ())
    rank, counted, steps = mesh.get_rank(), torch.zeros(8, dtype=torch.int64), []
    for step in range(3):
        x, y = (t[rank * TOKENS:(rank + 1) * TOKENS] for t in global_batch(step, dp * ep))
        for i, (x_m, y_m) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            sync = model.no_sync() if strategy == "ddp" and i < micro - 1 else contextlib.nullcontext()
            with sync:
                nn.functional.mse_loss(model(x_m), y_m).backward()
            counted += net.moe.last_expert_load
        steps.append((net.moe.expert_load.tolist(), counted.tolist()))
    return steps


def cases_job(world, dp: int, ep: int) -> dict:
    return {"errors": errors(dp, ep), "loads": {name: expert_load_counts(dp, ep, *mode)
                                                for name, mode in LOAD_MODES.items()},
            **{name: run_case(dp, ep, **case) for name, case in CASES.items()}}


@pytest.fixture(scope="module", params=[(2, 2), (1, 4)], ids=["dp2xep2", "ep4"])
def mesh_run(request, tmp_path_factory) -> tuple[tuple[int, int], list[dict]]:
    dp, ep = request.param
    job = functools.partial(cases_job, dp=dp, ep=ep)
    return request.param, spawn_ranks(rank_main, job, dp * ep, tmp_path_factory.mktemp(f"dp{dp}ep{ep}"),
                                      RUN_TIMEOUT_S)


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ep_rank: int, epn: int,
                   what: str) -> None:
    """Home experts against their rows of the reference's E experts, everything else whole."""
    assert got.keys() == want.keys()
    home = slice(ep_rank * epn, (ep_rank + 1) * epn)
    for name, value in got.items():
        ref = want[name][home] if name.startswith("moe.experts.") else want[name]
        torch.testing.assert_close(value, ref, **TOL, msg=lambda m, n=name: f"{what}: {n}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_every_gradient_and_step_equals_one_process_on_the_global_batch(mesh_run, case):
    (dp, ep), results = mesh_run
    clip, norm_type = CASES[case].get("clip"), CASES[case].get("norm_type", 2.0)
    ref_grads, ref_state, ref_norms = reference(dp * ep, clip, norm_type)
    assert all(norm > clip for norm in ref_norms), "clipping must scale the gradients"
    epn = 8 // ep
    for rank, result in enumerate(results):
        got = result[case]
        for step in range(STEPS):
            assert_matches(got["grads"][step], ref_grads[step], got["ep_rank"], epn,
                           f"{case}, rank {rank}, step {step} gradients")
        assert_matches(got["state"], ref_state, got["ep_rank"], epn, f"{case}, rank {rank}, final state")
        torch.testing.assert_close(got["norms"], ref_norms, **TOL)
    if ep > 1:
        assert results[0][case]["slots_used"] > 0, "the skewed routing made no replica in any step"


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_expert_load_counts_this_ep_groups_forwards_under_every_wrapper(mesh_run, mode):
    """`expert_load` is per EP group by meaning: under DDP (whose buffer sync would broadcast rank 0's at
    the first forward after a synchronised backward) and FSDP2, with and without micro-batches, each rank
    holds exactly its group's counts of every forward since the last reset."""
    (dp, _), results = mesh_run
    for rank, result in enumerate(results):
        for step, (load, counted) in enumerate(result["loads"][mode]):
            assert load == counted, f"{mode}, rank {rank}, step {step}: expert_load {load}, counted {counted}"
    if dp > 1:  # the groups saw different tokens, so a broadcast would have shown
        assert results[0]["loads"][mode][-1] != results[-1]["loads"][mode][-1]


# -- the training command: torchrun, DP x EP ----------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def tiny_train_yaml(folder: Path) -> Path:
    """The packaged tiny-transformer with 2 sequences of 8 tokens per rank and 3 steps."""
    data = yaml.safe_load((ROOT / "configs" / "tiny-transformer.yaml").read_text())
    data["train"].update({"batch_size": 2, "seq_len": 8, "steps": 3})
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torchrun_train_dp2_ep2_has_the_loss_curve_of_one_process_on_the_global_batch(tmp_path, device):
    """`torchrun --nproc-per-node 4 -m moonep_moe.apps.cli train --dp 2` (DDP over 4 processes, EP 2) prints
    the losses of one rank training on the 4 ranks' sequences at once, with balance and step time. On the CPU:
    gloo, the collective EP world, the same losses to the printed digits; on a GPU: 4 processes sharing it
    (gloo, the symmetric EP world), within bf16 noise (the GEMM backends differ with the row counts)."""
    pytest.importorskip("transformers")
    from moonep_moe.apps.train import load_train_config, train

    config = tiny_train_yaml(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
               "moonep_moe.apps.cli", "train", "--config", str(config), "--dp", "2"]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    backend = "gloo" if device == "cpu" or torch.cuda.device_count() < 4 else "nccl"
    assert f"DP 2 x EP 2 = 4 ranks as processes ({backend}) on the {device}" in run.stdout, run.stdout
    steps = re.findall(r"step +\d+  loss (\d+\.\d{4})  max/mean load: MoonEP (\d\.\d\d)  plain EP \d\.\d\d  "
                       r"slots used \d+  \d+ ms", run.stdout + run.stderr)
    one = train(load_train_config(config, ep_size=1, batch_size=8), device=device, progress=False)
    assert len(steps) == 3 and all(moonep == "1.00" for _, moonep in steps), run.stdout + run.stderr
    if device == "cpu":
        assert [loss for loss, _ in steps] == [f"{loss:.4f}" for loss in one["losses"]]
    else:
        torch.testing.assert_close([float(loss) for loss, _ in steps], one["losses"], rtol=0, atol=2e-2)


@pytest.mark.parametrize("argv, env, message", [
    (["--dp", "2"], {}, "--dp 2: the ranks are processes; run it under torchrun"),
    (["--dp", "3"], {"WORLD_SIZE": "4"}, "--dp 3 does not divide the 4 processes"),
    (["--dp", "2", "--ranks", "2"], {"WORLD_SIZE": "4"}, "--ranks 2: with --dp the ranks are torchrun's"),
    (["--dp", "2", "--save", "x.pt"], {"WORLD_SIZE": "4"}, "--save x.pt: checkpoints need thread-ranks"),
])
def test_train_dp_refuses_what_cannot_run_before_any_work(argv, env, message, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"moonep-moe: error: {message}"), err


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_on_thread_ranks_equals_torchs_on_one_process(norm_type):
    """Without a mesh (thread ranks, as `moonep-moe train` runs them): 4 EP ranks with one process's
    parameters, their replicated gradients averaged and the home experts' divided by 4 (the global batch's
    mean loss), then `clip_grad_norm_`: every gradient and the norm equal torch's `clip_grad_norm_` on one
    process holding every expert."""
    clip, ranks = 0.05, 4
    one = build(make_config(1, ranks * TOKENS), single_world())
    x, y = global_batch(0, ranks)
    nn.functional.mse_loss(one(x), y).backward()
    want_norm = float(nn.utils.clip_grad_norm_(one.parameters(), clip, norm_type))
    want = snapshot(one, grads=True)
    weights = {name: p.detach() for name, p in one.named_parameters()}

    def rank_fn(world):
        net = build(make_config(ranks, TOKENS), world)
        epn, experts = 8 // ranks, expert_parameters(net)
        with torch.no_grad():  # the one process's parameters (home experts: this rank's rows)
            for name, p in net.named_parameters():
                home = any(p is e for e in experts)
                p.copy_(weights[name][world.rank * epn:(world.rank + 1) * epn] if home else weights[name])
        x_r, y_r = (t[world.rank * TOKENS:(world.rank + 1) * TOKENS] for t in (x, y))
        nn.functional.mse_loss(net(x_r), y_r).backward()
        sync_grads(net, world)  # moonep-moe train's: replicated gradients averaged, home experts' over R
        norm = float(clip_grad_norm_(net, clip, norm_type=norm_type))
        return snapshot(net, grads=True), norm, int(net.moe.balance_stats()["slots_used"].sum())

    results = run_ranks(rank_fn, ranks)
    assert want_norm > clip and any(used for _, _, used in results), "clipping, with replicas"
    for rank, (grads, norm, _) in enumerate(results):
        assert_matches(grads, want, rank, 8 // ranks, f"rank {rank} gradients")
        assert norm == pytest.approx(want_norm, rel=1e-12)


def test_helpers_refuse_misuse_naming_the_rank(mesh_run):
    (dp, _), results = mesh_run
    for rank, result in enumerate(results):
        raised = result["errors"]
        assert raised["strategy"] == f"strategy must be 'ddp' or 'fsdp', got 'zero' (rank {rank})"
        assert raised["no grad"] == (f"MoonEP layer 0 experts.gate_up has no grad on rank {rank}: call "
                                     "reduce_expert_grads after backward")
        assert raised["max_norm"] == f"max_norm must be a positive number, got 0.0 (rank {rank})"
        assert raised["norm_type"] == f"norm_type must be a positive number, got '2' (rank {rank})"
        assert raised["nonfinite"].startswith("the total norm of order 2.0 of the gradients is nan, so they "
                                              f"cannot be clipped (rank {rank})")
        if dp == 1:  # the WORLD group is the mesh's "ep" group
            assert "other group" not in raised
            continue
        ep_ranks = [rank // 2 * 2, rank // 2 * 2 + 1]
        other = raised["other group"]
        assert other == (f"a MoonEPMoELayer of model was built on an EP world of ranks [0, 1, 2, 3], not the "
                         f"mesh's 'ep' dimension (ranks {ep_ranks}), on rank {rank}: build every layer with "
                         "MoonEPMoELayer(config, ep_world(mesh))")
        column = [rank % 2, rank % 2 + 2]  # the right size, the wrong experts: refused by both helpers
        for name in ("other ranks", "other ranks, reduce"):
            assert raised[name].startswith(f"a MoonEPMoELayer of model was built on an EP world of ranks "
                                           f"{column}, not the mesh's 'ep' dimension (ranks {ep_ranks}), on "
                                           f"rank {rank}"), raised[name]
