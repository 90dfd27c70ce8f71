"""The tables bench.layer measures: a packaged model's layer at EP=1, or ONE rank of an EP group of R ranks
(`Table`, made by `make_table` from `moonep_moe/configs/<model>.yaml` with the command line's shape
overrides; for one EP rank what its rows measure and leave out, `EP_RANK`, and its plan,
`table_rank_plan`), `MODEL_TABLES` (--model all) and `CPU_SMOKE` (--device cpu). The benchmarks that
measure one model's table as bench.layer does (bench.memory, bench.step_bytes, bench.wgrad_hygiene) take
its arguments (`add_table_arguments`, `table_from_arguments`) and its tables from here. Pure description:
nothing runs but the EP rank's plan."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.common import model_shape
from bench.ep_rank import RankPlan, ep_rank_groups, ep_rank_plan
from bench.layer_targets import EP_RANK_TARGETS, LAYER_TARGETS, MODEL_LAYER_TARGETS
from moonep_moe.config import MoEConfig

EP_RANK = ("one rank of an EP group of ep_rank_of ranks (--ep-rank-of), in a one-rank world (bench.ep_rank."
           "as_ep_rank): the group's routing at maxvio (bench.skew) planned by the real planner (balance "
           "exact), the rank hosting the most replicas (ep_rank_plan) with its S*K routes per home expert "
           "and per slot as planned (the router runs, its choice replaced by the plan's, planned_topk) "
           "through the real planner, row kernels, grouped GEMMs over home_experts home + slots slot "
           "groups (slot j holds home expert j; weights joined by the arena where it applies) and combine; "
           "prefetch and reduce_grad stood in for by local copies of the same bytes, for the slots the plan "
           "fills only. Left out: all peer traffic (the "
           "histogram all-gather, rows to and from other ranks, weights and gradients over NVLink), every "
           "wait on a peer, and the duplicate rows' expansion and pre-reduction (a one-rank plan has no "
           "duplicates; with K = R = 8 about a third of a real rank's routes are); the torch-native rows run "
           "the same routed work on home_experts + slots experts")
"""What the `--ep-rank-of` rows measure and leave out (the record's `setup.ep_rank`)."""


@dataclass(frozen=True)
class Table:
    """One table of the benchmark: a model's layer at EP=1, or (`ep_rank_of` R) ONE rank of an EP group of R
    ranks over `experts` experts (`as_ep_rank`: epn = E / R home + epn slot groups, of which the slots the
    group's plan at `maxvio` fills, `ep_rank_plan`). Pure description."""

    model: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    """E of the model (of the whole EP group for `ep_rank_of`)."""
    top_k: int
    ep_rank_of: int | None = None
    overrides: tuple[tuple[str, int], ...] = ()
    """The shapes given on the command line instead of the model's, `(name, value)`."""
    maxvio: float = 0.0
    """For `ep_rank_of`: the group's routing skew whose plan gives the rank's groups."""

    @property
    def epn(self) -> int | None:
        """Home experts (and slots) of the one rank, None at EP=1."""
        return None if self.ep_rank_of is None else ep_rank_groups(self.experts, self.ep_rank_of)[0]

    @property
    def shapes(self) -> dict[str, int]:
        """The one-rank layer's `MoEConfig` shapes (its experts: E, or epn home then epn slots)."""
        experts = self.experts if self.epn is None else 2 * self.epn
        return dict(hidden_size=self.hidden, ffn_hidden_size=self.ffn, num_experts=experts, top_k=self.top_k,
                    max_tokens_per_rank=self.tokens)

    def config(self, fields: dict) -> MoEConfig:
        """The one-rank layer's config with `fields` (`shapes`, then `fields`); for one EP rank a
        `token_padding` left out is the real rank's default (`MoEConfig` over `experts` on `ep_rank_of`
        ranks: it depends on the rows per home expert), not the stand-in's over `2 * epn` experts."""
        if self.ep_rank_of is not None and "token_padding" not in fields:
            group = {**self.shapes, "num_experts": self.experts, "ep_size": self.ep_rank_of, **fields}
            fields = {**fields, "token_padding": MoEConfig(**group).token_padding}
        return MoEConfig(**self.shapes, **fields)

    @property
    def setup(self) -> dict:
        """What a record's `setup` says of the table: the model, its shapes (E of the one-rank layer), R and
        the maxvio of the rank's plan."""
        return {"model": self.model, "tokens": self.tokens, "hidden": self.hidden, "ffn": self.ffn,
                "experts": self.shapes["num_experts"], "top_k": self.top_k, "ep_rank_of": self.ep_rank_of,
                "maxvio": self.maxvio}

    @property
    def label(self) -> str:
        where = "EP=1" if self.ep_rank_of is None else f"one rank of EP={self.ep_rank_of}"
        if self.ep_rank_of is not None and self.maxvio:
            where += f" at maxvio {self.maxvio:g}"
        given = "".join(f", {name}={value}" for name, value in self.overrides)
        return f"{self.model} {where}{given}"

    @property
    def record_name(self) -> str:
        """`layer-<model>`, then `-ep<R>-rank` for one EP rank (`-maxvio<m>` where not 0) and `-custom` with
        overrides."""
        rank = "" if self.ep_rank_of is None else f"-ep{self.ep_rank_of}-rank"
        if self.ep_rank_of is not None and self.maxvio:
            rank += f"-maxvio{self.maxvio:g}"
        return f"layer-{self.model}{rank}{'-custom' if self.overrides else ''}"

    @property
    def bounds(self) -> tuple:
        """The DEFAULT row's targets: `EP_RANK_TARGETS` for one EP rank of the model's shapes, the model's
        own `MODEL_LAYER_TARGETS` at EP=1 where it has them, else `LAYER_TARGETS`."""
        if self.overrides:
            return LAYER_TARGETS
        if self.ep_rank_of is not None:
            return EP_RANK_TARGETS
        return MODEL_LAYER_TARGETS.get(self.model, LAYER_TARGETS)

    @property
    def scope(self) -> str:
        """Which targets the DEFAULT row's checks are (`bounds`)."""
        if self.overrides:
            return "custom shapes: the EP=1 layer's bounds, for comparison only"
        if self.ep_rank_of is not None:
            return f"one rank of EP={self.ep_rank_of} with a real plan's slots, whole layer"
        if self.model == "deepseek-v3":
            return "the EP=1 layer"
        if self.model in MODEL_LAYER_TARGETS:
            return f"the EP=1 layer of {self.model}"
        return "no target of its own: the EP=1 layer's bounds, to say where it stands"


SHAPE_ARGS = ("tokens", "hidden", "ffn", "experts", "top_k")
"""The command line's shape options, each overriding the model's value where given."""

MODEL_TABLES = (("deepseek-v3", None), ("deepseek-v3", 8), ("kimi-k2", 8), ("qwen3-moe-30b-a3b", None),
                ("mixtral-8x7b", None))
"""`--model all`: the whole model table, `(model, ep_rank_of)`: DeepSeek-V3 at EP=1, one rank of
EP=8 for DeepSeek-V3 and Kimi-K2, Qwen3-MoE-30B-A3B and Mixtral-8x7B at EP=1."""

CPU_SMOKE = {"tokens": 64, "hidden": 64, "ffn": 32}
"""`--device cpu`: the model's E and K (and R), on these tiny T, H and H' unless given."""


def make_table(model: str, ep_rank_of: int | None, overrides: dict[str, int], maxvio: float = 0.0) -> Table:
    """The `Table` of a packaged model config (`bench.common.model_shape`), with `overrides` (SHAPE_ARGS
    keys) in place of its shapes; `maxvio` for an EP rank's plan. Raises ValueError naming --ep-rank-of
    where R does not divide E."""
    unknown = set(overrides) - set(SHAPE_ARGS)
    if unknown:
        raise ValueError(f"make_table: overrides must be among {SHAPE_ARGS}, got {sorted(unknown)}")
    shape = {key: model_shape(model)[key] for key in SHAPE_ARGS}
    table = Table(model, **{**shape, **overrides}, ep_rank_of=ep_rank_of,
                  overrides=tuple((key, overrides[key]) for key in SHAPE_ARGS if key in overrides),
                  maxvio=maxvio if ep_rank_of is not None else 0.0)
    if ep_rank_of is not None:
        ep_rank_groups(table.experts, ep_rank_of)  # raises, naming --ep-rank-of, before any kernel runs
    return table


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --ep-rank-of and --maxvio, as a bench that measures one packaged model's `Table` takes them
    (`table_from_arguments`)."""
    parser.add_argument("--model", default="deepseek-v3", help="a packaged model config (bench.layer's)")
    parser.add_argument("--ep-rank-of", type=int, default=None, metavar="R",
                        help="one rank of EP=R (bench.layer's --ep-rank-of)")
    parser.add_argument("--maxvio", type=float, default=0.0,
                        help="with --ep-rank-of: the group's routing skew")


def table_from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Table:
    """`make_table` of `add_table_arguments`' values (the model's own shapes); what it refuses is the
    parser's error (exit 2, the message naming the argument)."""
    try:
        return make_table(args.model, args.ep_rank_of, {}, args.maxvio)
    except ValueError as error:
        parser.error(str(error))


def table_rank_plan(table: Table, device: torch.device | str) -> RankPlan | None:
    """The EP rank of an `ep_rank_of` table (`ep_rank_plan` at its maxvio, routed on `device`), else None."""
    if table.ep_rank_of is None:
        return None
    return ep_rank_plan(table.experts, table.ep_rank_of, table.tokens, table.top_k, table.maxvio, device)
