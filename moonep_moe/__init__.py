"""moonep-moe: an expert-parallel MoE layer for PyTorch with MoonEP-style dynamic redundant experts.

The public API is `__all__`. `import moonep_moe` imports torch and the layer, never an optional dependency:
the names of modules that need one, or that join a process group, load on first use (`_LAZY`).
"""

from importlib import import_module, metadata
from typing import Any

from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.event import CommEvent
from moonep_moe.comm.pool import BufferPool
from moonep_moe.config import (
    CommConfig,
    MoEConfig,
    RouterConfig,
    SharedExpertConfig,
    available_configs,
    load_config,
)
from moonep_moe.engine.communicator import MoECommunicator
from moonep_moe.engine.layout import ExpertLayout
from moonep_moe.layers.moe import MoonEPMoELayer, fixed_expert_weights
from moonep_moe.plan.types import MoonEPCommPlan
from moonep_moe.transport.threads import run_ranks
from moonep_moe.transport.world import EPWorld

try:
    __version__ = metadata.version("moonep-moe")
except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_LAZY = {
    "swap_moe_blocks": "moonep_moe.integrations.hf",  # the `hf` extra (transformers)
    "hf_state_dict": "moonep_moe.integrations.hf",
    "init_collective": "moonep_moe.transport.collective",  # torch.distributed process groups
    "fail_fast": "moonep_moe.transport.collective",
    "RankFailedError": "moonep_moe.transport.collective",
    "init_symmetric": "moonep_moe.transport.symmetric",  # torch symmetric memory (CUDA)
}
"""Public names imported on first access: module that defines each."""

__all__ = [
    "Buffer",
    "BufferPool",
    "CommConfig",
    "CommEvent",
    "EPWorld",
    "ExpertLayout",
    "MoECommunicator",
    "MoEConfig",
    "MoonEPCommPlan",
    "MoonEPMoELayer",
    "RouterConfig",
    "SharedExpertConfig",
    "available_configs",
    "fixed_expert_weights",
    "load_config",
    "run_ranks",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'moonep_moe' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
