"""`moonep-moe train`: a tiny transformers Qwen3-MoE, its MoE blocks swapped for `MoonEPMoELayer`, trained on
a synthetic Markov chain with R EP ranks as threads (needs the `hf` extra).

Shapes use the suffix letters of DESIGN.md, "Notation"; the data's own sizes are spelled out:
`ids [batch_size, seq_len]` token ids of one rank's batch, `probs [vocab, vocab]` the Markov chain.

Every rank holds a full copy of the non-expert model (data parallel) and its home experts (expert parallel),
and draws its own batch. One step (`train_step`):
1. forward + backward of the rank's batch (the MoE layers exchange tokens and gradients inside);
2. gradients: replicated parameters are averaged over the ranks (all-gather + mean, so every rank gets the
   same bits and the replicas stay identical); home experts already hold the gradient of every rank's
   tokens and are divided by R, so the step minimises the mean of the ranks' losses;
3. AdamW step.

Data are a pure function of (seed, step, rank), so a run resumed at the same EP size sees the same batches.
Checkpoints (`save_checkpoint`) hold the model's state_dict merged over ranks (experts under their global ids,
loadable at any EP size), the optimizer state keyed by parameter name and global expert, the step, the global
batch (kept when a run resumes at another EP size) and the RNG state.
Slot pools are neither parameters nor buffers, so they never reach a checkpoint or the optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from tqdm import tqdm

from moonep_moe.comm.world import EPWorld, run_ranks
from moonep_moe.config import read_config_yaml
from moonep_moe.layers.moe import MoonEPMoELayer

__all__ = ["TrainConfig", "load_checkpoint", "load_train_config", "resumed_config", "train"]


class TrainSection(BaseModel):
    """The `train:` section of a training YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ep_size: int = Field(2, ge=1, description="EP ranks (threads); 1 on a GPU.")
    steps: int = Field(60, ge=0, description="Optimizer steps in total (a resumed run continues to it).")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate (no schedule, no weight decay).")
    batch_size: int = Field(8, ge=1, description="Sequences per rank per step. A resumed run keeps its "
                            "checkpoint's global batch: this becomes that batch / ep_size.")
    seq_len: int = Field(32, ge=2, description="Tokens per sequence.")
    seed: int = Field(0, description="Seeds the model, the Markov chain and every batch.")
    branching: int = Field(2, ge=1, description="Likely successors per token in the Markov chain.")
    skew: float = Field(0.0, ge=0, description="Selection bias added to the first top_k experts of every "
                        "layer (frozen): 0 = plain routing; large values send nearly every token there.")


class TrainConfig(BaseModel):
    """A training run: `model` (transformers `Qwen3MoeConfig` fields), `moe` (`MoEConfig` overrides for every
    swapped block), `train`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: dict[str, Any]
    moe: dict[str, Any] = Field(default_factory=dict)
    train: TrainSection = Field(default_factory=TrainSection)


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
    """`[batch_size, seq_len]` token ids of rank `rank` at `step`, a pure function of (seed, step, rank)."""
    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1_009 + rank)
    ids = torch.empty(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(0, probs.shape[0], (cfg.batch_size,), generator=gen)
    for t in range(1, cfg.seq_len):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=gen).squeeze(1)
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


def moe_layers(model: nn.Module) -> list[MoonEPMoELayer]:
    return [m for m in model.modules() if isinstance(m, MoonEPMoELayer)]


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


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, world: EPWorld,
               ids: torch.Tensor) -> torch.Tensor:
    """One step on this rank's batch `ids [batch_size, seq_len]`; returns the rank's loss (detached)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids.to(world.device), labels=ids.to(world.device)).loss
    loss.backward()
    sync_grads(model, world)
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
          log: Callable[[str], None] | None = None, keep_states: bool = False,
          progress: bool = True) -> dict[str, Any]:
    """Run `cfg` from step 0 (or from the checkpoint `resume`, keeping its global batch: `resumed_config`)
    to `cfg.train.steps`.

    Returns `losses` (mean over ranks, per step run), `balance` (per step: replicas and plain-EP max/mean
    load and slots used, worst over layers, rank 0's view: the plan is global), and with `keep_states` the
    merged model state_dict after every step (`states`). `log` receives one line per step.
    """
    import transformers

    checkpoint = load_checkpoint(resume) if resume else None
    if checkpoint:
        cfg = resumed_config(cfg, checkpoint)
    tc = cfg.train
    start = checkpoint["step"] if checkpoint else 0
    torch.manual_seed(tc.seed)
    base = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg.model)).float()
    if checkpoint:
        torch.set_rng_state(checkpoint["rng"])
    probs = markov_chain(cfg.model["vocab_size"], tc.branching, tc.seed)
    steps = range(start, tc.steps)
    bar = tqdm(steps, desc="train", disable=not progress, leave=False)
    records: list[list[dict[str, Any]]] = [[] for _ in range(tc.ep_size)]

    def rank_fn(world: EPWorld) -> dict[str, Any]:
        model = build_model(cfg, world, base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=0.0)
        if checkpoint:
            model.load_state_dict(checkpoint["model"])
            load_optimizer_state(model, optimizer, checkpoint["optimizer"])
        for step in steps:
            loss = train_step(model, optimizer, world, sample_batch(probs, tc, step, world.rank))
            losses_r = world.all_gather(loss.float().reshape(1))
            record = {"loss": float(losses_r.mean())}
            if keep_states:
                record["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            if world.rank == 0:
                record["balance"] = balance(model)
                if log:
                    log(format_step(step, record))
                bar.update()
            records[world.rank].append(record)
        return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer_state(model, optimizer)}

    shards = run_ranks(rank_fn, tc.ep_size, device=device)
    bar.close()
    if save:
        save_checkpoint(save, shards, tc.steps, tc.batch_size * tc.ep_size)
    result = {"losses": [r["loss"] for r in records[0]], "balance": [r["balance"] for r in records[0]]}
    if keep_states:
        result["states"] = [{k: v for rank in records for k, v in rank[i]["state"].items()}
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
            f"plain EP {b['plain_ep']:.2f}  slots used {b['slots']}")
