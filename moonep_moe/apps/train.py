"""`moonep-moe train`: a tiny transformers Qwen3-MoE, its MoE blocks swapped for `MoonEPMoELayer`, trained on
a synthetic Markov chain (needs the `hf` extra), with R EP ranks as threads, or as DP x EP processes under
torchrun.

Shapes use the suffix letters of DESIGN.md, "Notation"; the data's own sizes are spelled out:
`ids [batch_size, seq_len]` token ids of one rank's batch, `probs [vocab, vocab]` the Markov chain; W is the
number of ranks in all (R threads, or dp x ep processes).

Every rank holds a full copy of the non-expert model (data parallel) and its home experts (expert parallel),
and trains on its own block of the step's global batch. One step (`train_step`):
1. forward + backward of the rank's batch (the MoE layers exchange tokens and gradients inside);
2. gradients (`Ranks.sync_grads`), so that the step minimises the mean of the W ranks' losses:
   - threads (`ThreadRanks`, EP only): replicated parameters averaged over the ranks (all-gather + mean, so
     every rank gets the same bits and the replicas stay identical); home experts already hold the gradient
     of every rank's tokens and are divided by R;
   - processes (`MeshRanks`, a `(dp, ep)` mesh): DDP averages the replicated parameters over all W ranks,
     `moonep_moe.parallel.reduce_expert_grads` sums the home experts over "dp" and divides by W;
3. with `train.max_grad_norm`, the gradients clipped by their global norm (`Ranks.clip`:
   `moonep_moe.parallel.clip_grad_norm_`, the home experts' squares summed over the EP world);
4. AdamW step.

Data are a pure function of (seed, step, sequence index in the global batch), so every split of one global
batch over ranks, at any EP or DP size, trains on the same sequences, and a resumed run sees the batches the
uninterrupted run would.
Checkpoints (`save_checkpoint`, threads only) hold the model's state_dict merged over ranks (experts under
their global ids, loadable at any EP size), the optimizer state keyed by parameter name and global expert,
the step, the global batch (kept when a run resumes at another EP size) and the RNG state.
Slot pools are neither parameters nor buffers, so they never reach a checkpoint or the optimizer.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field, StrictInt
from torch import nn
from tqdm import tqdm

from moonep_moe.config import read_config_yaml
from moonep_moe.config.rules import CONFIG_RULES
from moonep_moe.parallel import (
    clip_grad_norm_,
    data_parallel,
    ep_world,
    moe_layers,
    moe_mesh,
    reduce_expert_grads,
)
from moonep_moe.transport.threads import run_ranks
from moonep_moe.transport.world import EPWorld

__all__ = ["TrainConfig", "load_checkpoint", "load_train_config", "resumed_config", "train"]


class TrainSection(BaseModel):
    """The `train:` section of a training YAML."""

    model_config = CONFIG_RULES

    ep_size: StrictInt = Field(2, ge=1, description="EP ranks (threads); 1 on a GPU.")
    steps: StrictInt = Field(60, ge=0, description="Optimizer steps in total (a resumed run continues to "
                             "it).")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate (no schedule, no weight decay).")
    max_grad_norm: float | None = Field(None, gt=0, description="Clip each step's gradients to this global "
                                        "norm (`moonep_moe.parallel.clip_grad_norm_`: the norm one process "
                                        "on the global batch would clip by); None: no clipping.")
    batch_size: StrictInt = Field(8, ge=1, description="Sequences per rank per step. A resumed run keeps "
                                  "its checkpoint's global batch: this becomes that batch / ep_size.")
    seq_len: StrictInt = Field(32, ge=2, description="Tokens per sequence.")
    seed: StrictInt = Field(0, description="Seeds the model, the Markov chain and every batch.")
    branching: StrictInt = Field(2, ge=1, description="Likely successors per token in the Markov chain.")
    skew: float = Field(0.0, ge=0, description="Selection bias added to the first top_k experts of every "
                        "layer (frozen): 0 = plain routing; large values send nearly every token there.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="The model's dtype: its parameters "
                                                  "and activations, the MoonEP layers' included (`precision: "
                                                  "fp8` experts need bfloat16).")


class TrainConfig(BaseModel):
    """A training run: `model` (transformers `Qwen3MoeConfig` fields), `moe` (`MoEConfig` overrides for every
    swapped block), `train`."""

    model_config = CONFIG_RULES

    model: dict[str, Any]
    moe: dict[str, Any] = Field(default_factory=dict)
    train: TrainSection = Field(default_factory=TrainSection)

    def with_moe(self, **fields: Any) -> TrainConfig:
        """This config with `fields` added to its `moe:` overrides (validated when the blocks are swapped),
        e.g. `with_moe(precision="fp8")`."""
        return self.model_copy(update={"moe": {**self.moe, **fields}})


def load_train_config(path_or_name: str | Path, **train_overrides: Any) -> TrainConfig:
    """Read a training YAML: a path, or a packaged name (`"tiny-transformer"`, listed by
    `available_configs("train")`); `train_overrides` replace fields of its `train:` section. Errors as
    `moonep_moe.config.load_config`'s."""
    data, _ = read_config_yaml(path_or_name, "train")
    data["train"] = {**(data.get("train") or {}), **train_overrides}
    return TrainConfig.model_validate(data)


def markov_chain(vocab: int, branching: int, seed: int) -> torch.Tensor:
    """`[vocab, vocab]` transition probabilities: each token has `branching` likely successors (90% of the
    mass)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 0.1 / vocab)
    for v in range(vocab):
        probs[v, torch.randperm(vocab, generator=gen)[:branching]] += 0.9 / branching
    return probs / probs.sum(-1, keepdim=True)


def sample_batch(probs: torch.Tensor, cfg: TrainSection, step: int, rank: int) -> torch.Tensor:
    """`[batch_size, seq_len]` token ids of rank `rank` at `step`: sequences `[rank * batch_size, (rank + 1) *
    batch_size)` of the step's global batch, each a pure function of (seed, step, its index in it)."""
    ids = torch.empty(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    for i in range(cfg.batch_size):
        index = rank * cfg.batch_size + i
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1_000_033 + index)
        ids[i, 0] = torch.randint(0, probs.shape[0], (), generator=gen)
        for t in range(1, cfg.seq_len):
            ids[i, t] = torch.multinomial(probs[ids[i, t - 1]], 1, generator=gen)
    return ids


def build_model(cfg: TrainConfig, world: EPWorld, base: nn.Module) -> nn.Module:
    """This rank's copy of `base` (the HF model) with its MoE blocks swapped, skewed when `train.skew` > 0."""
    from moonep_moe.integrations.hf import swap_moe_blocks

    overrides = dict(cfg.moe)
    if cfg.train.skew:
        frozen_bias = {"expert_bias": True, "expert_bias_update_rate": 0.0}
        overrides["router"] = {**overrides.get("router", {}), **frozen_bias}
    model = copy.deepcopy(base).to(world.device)
    swap_moe_blocks(model, cfg.train.batch_size * cfg.train.seq_len, world, **overrides)
    for layer in moe_layers(model):
        if cfg.train.skew:
            with torch.no_grad():
                layer.router.expert_bias[: layer.config.top_k] += cfg.train.skew
    return model


def expert_params(model: nn.Module) -> dict[nn.Parameter, range]:
    """Each home-expert parameter (`[epn, ...]`) and the global expert ids of its rows."""
    return {p: layer.experts.home_experts for layer in moe_layers(model)
            for p in (layer.experts.gate_up, layer.experts.down)}


@torch.no_grad()
def sync_grads(model: nn.Module, world: EPWorld) -> None:
    """Step 2 of the module docstring: average replicated gradients, scale home-expert gradients by 1/R."""
    experts = expert_params(model)
    for p in model.parameters():
        if p.grad is None:
            continue
        if p in experts:
            p.grad.div_(world.size)
        elif world.size > 1:  # gather a copy: peers may still be reading it when this rank writes p.grad
            p.grad.copy_(world.all_gather(p.grad.clone()).mean(0))


class ThreadRanks:
    """Rank `world.rank` of R thread-ranks of this process, EP only (`world` a threads world): its batch is
    block `world.rank` of R, gradients are synchronised by `sync_grads`."""

    def __init__(self, world: EPWorld):
        self.world, self.shard, self.shards, self.lead = world, world.rank, world.size, world.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def sync_grads(self, model: nn.Module) -> None:
        sync_grads(model, self.world)

    def clip(self, model: nn.Module, max_norm: float) -> None:
        clip_grad_norm_(model, max_norm)

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over the ranks."""
        return float(self.world.all_gather(value.float().reshape(1)).mean())


class MeshRanks:
    """This process as rank (d, r) of a `(dp, ep)` mesh of the default process group (torchrun): its batch is
    block `d * ep + r` of W, the model is wrapped in DDP over all W ranks and the home experts are reduced
    over "dp" (`moonep_moe.parallel`)."""

    def __init__(self, dp: int, ep: int, device: torch.device):
        self.mesh = moe_mesh(dp, ep, device.type)
        if device.type == "cuda":  # ranks may share a GPU (a gloo group)
            gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            self.world = ep_world(self.mesh, "symmetric", device=gpu)
        else:
            self.world = ep_world(self.mesh)
        self.shard, self.shards = self.mesh.get_rank(), self.mesh.size()
        self.lead = self.shard == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        return data_parallel(model, self.mesh, "ddp")

    def sync_grads(self, model: nn.Module) -> None:
        reduce_expert_grads(model, self.mesh)

    def clip(self, model: nn.Module, max_norm: float) -> None:
        clip_grad_norm_(model, max_norm, self.mesh)

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all W ranks."""
        total = value.detach().float().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / self.shards


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: ThreadRanks | MeshRanks,
               ids: torch.Tensor, max_grad_norm: float | None = None) -> torch.Tensor:
    """One step on this rank's batch `ids [batch_size, seq_len]` (`model` as `ranks.wrap` gave it), its
    gradients clipped to `max_grad_norm` where given; returns the rank's loss (detached)."""
    device = ranks.world.device
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
    loss.backward()
    ranks.sync_grads(model)
    if max_grad_norm is not None:
        ranks.clip(model, max_grad_norm)
    optimizer.step()
    return loss.detach()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state by parameter name; home experts split into `{name}.{expert}`
    entries (one row each), so the state loads at any EP size."""
    experts, out = expert_params(model), {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        if p not in experts:
            out[name] = {k: v.detach().cpu().clone() for k, v in state.items()}
            continue
        for i, e in enumerate(experts[p]):
            out[f"{name}.{e}"] = {k: (v[i] if v.dim() else v).detach().cpu().clone()
                                  for k, v in state.items()}
    return out


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Inverse of `optimizer_state` for this rank's parameters (home experts stacked from their entries)."""
    experts = expert_params(model)
    for name, p in model.named_parameters():
        if p not in experts:
            state = saved[name]
        else:
            rows = [saved[f"{name}.{e}"] for e in experts[p]]
            state = {k: torch.stack([r[k] for r in rows]) if rows[0][k].dim() else rows[0][k]
                     for k in rows[0]}
        # copies: every rank reads the same checkpoint tensors, and optimizers update their state in place
        optimizer.state[p] = {k: v.to(p.device, copy=True) if v.dim() else v.clone()
                              for k, v in state.items()}


CHECKPOINT_KEYS = ("model", "optimizer", "step", "global_batch", "rng")


def save_checkpoint(path: str | Path, shards: list[dict[str, Any]], step: int, global_batch: int) -> None:
    """Write the ranks' `{"model", "optimizer"}` shards merged into one file, with the step, the global batch
    (sequences per step over all ranks) and the RNG state."""
    merged = {key: {k: v for shard in shards for k, v in shard[key].items()}
              for key in ("model", "optimizer")}
    torch.save({**merged, "step": step, "global_batch": global_batch, "rng": torch.get_rng_state()}, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (tensors on the CPU).

    Raises:
        FileNotFoundError: no such file.
        ValueError (one line, naming the file): torch cannot read it, or it lacks one of `CHECKPOINT_KEYS`.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint not found: {str(path)!r}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises what its unpickler or zip reader raised
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        raise ValueError(f"{path}: not a checkpoint torch.load can read ({reason})") from error
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing:
        raise ValueError(f"{path}: not a moonep-moe train checkpoint (no {', '.join(missing)})")
    return checkpoint


def resumed_config(cfg: TrainConfig, checkpoint: dict[str, Any]) -> TrainConfig:
    """`cfg` to continue `checkpoint` with: the checkpoint's global batch split over `cfg.train.ep_size`
    ranks (`batch_size` per rank), so that resuming at another EP size trains on the same global batch.

    Raises:
        ValueError: `cfg.train.steps` is not beyond the checkpoint's step (nothing to train), or the global
            batch does not divide over the ranks.
    """
    tc, step, global_batch = cfg.train, checkpoint["step"], checkpoint["global_batch"]
    if tc.steps <= step:
        raise ValueError(f"steps={tc.steps} is not beyond the checkpoint's step {step}: nothing to train")
    if global_batch % tc.ep_size:
        raise ValueError(f"the checkpoint's global batch of {global_batch} sequences does not split evenly "
                         f"over {tc.ep_size} EP ranks; use a number of ranks that divides {global_batch}")
    return cfg.model_copy(update={"train": tc.model_copy(update={"batch_size": global_batch // tc.ep_size})})


def train(cfg: TrainConfig, device: str = "cpu", save: str | None = None, resume: str | None = None,
          log: Callable[[str], None] | None = None, keep_states: bool = False, progress: bool = True,
          dp: int | None = None) -> dict[str, Any]:
    """Run `cfg` from step 0 (or from the checkpoint `resume`, keeping its global batch: `resumed_config`)
    to `cfg.train.steps`.

    `dp` None: `cfg.train.ep_size` EP ranks as threads of this process (`ThreadRanks`). An int: this process
    is one rank of a job of `dp * cfg.train.ep_size` processes (torchrun; the default process group
    initialised), on a `(dp, ep)` mesh (`MeshRanks`): every process calls `train`; `device` "cpu" runs the
    collective world (gloo), "cuda" the symmetric world on `cuda:LOCAL_RANK % GPUs` (ranks may share a GPU:
    a gloo group and `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`). Checkpoints and `keep_states` are for
    thread-ranks only.

    Returns `losses` (mean over all ranks, per step run), `balance` (per step: replicas and plain-EP max/mean
    load and slots used, worst over layers; the EP group's plan, identical on its ranks), `seconds` (each
    step's wall time on rank 0 of this process), with `keep_states` the merged model state_dict after every
    step (`states`), and `model`: the final state_dict merged over the thread-ranks (processes: this rank's,
    its home experts under their global ids). `log` receives one line per step (from rank 0 only).

    Raises:
        ValueError: with `dp`, no initialised process group of `dp * ep_size` ranks, or `save`, `resume` or
            `keep_states` given.
    """
    import transformers

    tc = cfg.train
    if dp is not None:
        if save or resume or keep_states:
            raise ValueError("save, resume and keep_states need thread-ranks (dp=None): with dp the ranks "
                             "are processes")
        size = dist.get_world_size() if dist.is_initialized() else None
        if size != dp * tc.ep_size:
            raise ValueError(f"dp={dp} x ep_size={tc.ep_size} needs a process group of {dp * tc.ep_size} "
                             f"ranks (torchrun), got {size or 'none'}")
    checkpoint = load_checkpoint(resume) if resume else None
    if checkpoint:
        cfg = resumed_config(cfg, checkpoint)
    tc = cfg.train
    start = checkpoint["step"] if checkpoint else 0
    torch.manual_seed(tc.seed)
    hf_model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg.model))
    base = hf_model.to(getattr(torch, tc.dtype))
    if checkpoint:
        torch.set_rng_state(checkpoint["rng"])
    probs = markov_chain(cfg.model["vocab_size"], tc.branching, tc.seed)
    steps = range(start, tc.steps)
    records: dict[int, list[dict[str, Any]]] = {}

    def rank_fn(ranks: ThreadRanks | MeshRanks) -> dict[str, Any]:
        model = build_model(cfg, ranks.world, base)
        wrapped = ranks.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=0.0)
        if checkpoint:
            model.load_state_dict(checkpoint["model"])
            load_optimizer_state(model, optimizer, checkpoint["optimizer"])
        mine = records.setdefault(ranks.shard, [])
        bar = tqdm(steps, desc="train", disable=not (progress and ranks.lead), leave=False)
        for step in steps:
            begin = time.perf_counter()
            loss = train_step(wrapped, optimizer, ranks, sample_batch(probs, tc, step, ranks.shard),
                              tc.max_grad_norm)
            record = {"loss": ranks.mean(loss), "seconds": time.perf_counter() - begin,
                      "balance": balance(model)}
            if keep_states:
                record["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            if ranks.lead and log:
                log(format_step(step, record))
            bar.update()
            mine.append(record)
        bar.close()
        return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer_state(model, optimizer)}

    if dp is None:
        shards = run_ranks(lambda world: rank_fn(ThreadRanks(world)), tc.ep_size, device=device)
    else:
        shards = [rank_fn(MeshRanks(dp, tc.ep_size, torch.device(device)))]
    if save:
        save_checkpoint(save, shards, tc.steps, tc.batch_size * tc.ep_size)
    first = records[min(records)]
    result = {key: [r[key] for r in first] for key in ("loss", "balance", "seconds")}
    result["losses"] = result.pop("loss")
    if keep_states:
        result["states"] = [{k: v for rank in records.values() for k, v in rank[i]["state"].items()}
                            for i in range(len(steps))]
    result["model"] = {k: v for shard in shards for k, v in shard["model"].items()}
    return result


def balance(model: nn.Module) -> dict[str, float]:
    """The last step's balance, worst over the layers: max/mean routes per rank with replicas and with plain
    EP, and the most slots a rank used (reads device values: one host sync per step)."""
    stats = [layer.balance_stats() for layer in moe_layers(model)]
    return {"moonep": max(float(s["max_load"] / s["mean_load"]) for s in stats),
            "plain_ep": max(float(s["ep_max_load"] / s["ep_mean_load"]) for s in stats),
            "slots": max(int(s["slots_used"].max()) for s in stats)}


def format_step(step: int, record: dict[str, Any]) -> str:
    b = record["balance"]
    return (f"step {step + 1:4d}  loss {record['loss']:.4f}  max/mean load: MoonEP {b['moonep']:.2f}  "
            f"plain EP {b['plain_ep']:.2f}  slots used {b['slots']}  {record['seconds'] * 1e3:.0f} ms")
