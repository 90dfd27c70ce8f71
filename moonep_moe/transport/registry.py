"""The EP worlds as one table, and the one place that builds a world of a process group.

Each world is one module (`threads`, `symmetric`, `collective`) and one row of `WORLDS`: its config name, what
it is for, and how a process group becomes that world (None for thread ranks, which have no process group).
`MoEConfig.world` takes its choices from this table; `MoonEPMoELayer` and `moonep_moe.parallel.ep_world` build
through `world_of_group`. Adding a world: one module implementing the `EPWorld` protocol, plus one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moonep_moe.transport.world import EPWorld


def _symmetric(group: dist.ProcessGroup | None, device: torch.device | None, exact_size: bool) -> EPWorld:
    from moonep_moe.transport.symmetric import symmetric_world

    return symmetric_world(group, device)


def _collective(group: dist.ProcessGroup | None, device: torch.device | None, exact_size: bool) -> EPWorld:
    from moonep_moe.transport.collective import collective_world

    return collective_world(group, exact_size)


@dataclass(frozen=True)
class WorldKind:
    """One row of the table.

    Attributes:
        name: its `MoEConfig.world` value.
        description: what it is for.
        of_group: `(group, device, exact_size) -> world`, this process's world of a process group (None for
            the WORLD group; `device` where the world needs one, default `cuda:LOCAL_RANK`); None where the
            ranks are threads of one process (`run_ranks`).
    """

    name: str
    description: str
    of_group: Callable[[dist.ProcessGroup | None, torch.device | None, bool], EPWorld] | None


WORLDS: dict[str, WorldKind] = {kind.name: kind for kind in (
    WorldKind("threads", "R ranks as threads of one process (`run_ranks`), on the CPU or one GPU: tests, "
              "demos, one-device simulation; one rank where no world is given", None),
    WorldKind("symmetric", "torch symmetric memory inside one NVLink domain, one process per GPU "
              "(production): the row kernels write into peers' memory", _symmetric),
    WorldKind("collective", "torch.distributed all-to-all over NCCL or gloo, one process per rank "
              "(beyond one NVLink domain, and the CPU)", _collective),
)}
"""Every EP world by name; the first is the default."""
WORLD_NAMES = tuple(WORLDS)


def world_of_group(name: str, group: dist.ProcessGroup | None = None, device: torch.device | None = None, *,
                   exact_size: bool = False) -> EPWorld:
    """This process's world `name` of `group` (None: the initialised default group). One per process, group
    and device, so every layer built on it shares its slot pools and Buffers.

    Raises:
        ValueError naming `world` (and the rank) for a world that has no process group ("threads") or an
        unknown name.
    """
    kind = WORLDS.get(name)
    if kind is None or kind.of_group is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"rank {rank}: world={name!r} is not a world of a process group; use one of "
                         f"{[k.name for k in WORLDS.values() if k.of_group is not None]}")
    return kind.of_group(group, device, exact_size)


def world_of_process_group(group: dist.ProcessGroup | None = None) -> EPWorld:
    """The world a process group stands for where only the group is given (MoonEP's `Buffer(...,
    group=group)`; None: the initialised default group): symmetric memory for an NCCL group (one NVLink
    domain, MoonEP's setting), the collective world for any other backend (gloo: the CPU). One per process
    and group (`world_of_group`), so Buffers and layers built on the group share it.

    Raises:
        ValueError where torch.distributed is not initialised (there is no group to derive a world from).
    """
    if not dist.is_initialized():
        raise ValueError("rank 0: group: torch.distributed is not initialised, so there is no process group "
                         "to build the EP world of; initialise it (torchrun, then init_process_group or "
                         "moonep_moe.transport.collective.init_collective) or pass world= (e.g. "
                         "moonep_moe.run_ranks's thread ranks, or transport.threads.single_world())")
    name = "symmetric" if "nccl" in str(dist.get_backend(group)) else "collective"
    return world_of_group(name, group)
