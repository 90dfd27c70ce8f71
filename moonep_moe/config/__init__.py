"""Typed configuration: the pydantic models (`models`) and the YAML files that hold them (`files`)."""

from moonep_moe.config.files import available_configs, load_config, packaged_configs_folder, read_config_yaml
from moonep_moe.config.models import (
    CommConfig,
    MoEConfig,
    RouterConfig,
    SharedExpertConfig,
    with_derived_defaults,
)

__all__ = [
    "CommConfig",
    "MoEConfig",
    "RouterConfig",
    "SharedExpertConfig",
    "available_configs",
    "load_config",
    "packaged_configs_folder",
    "read_config_yaml",
    "with_derived_defaults",
]
