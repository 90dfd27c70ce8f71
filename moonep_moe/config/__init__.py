"""Typed configuration: the pydantic models (`models`, their comm part `comm`, the rules every model keeps:
`rules`) and the YAML files that hold them (`files`)."""

from moonep_moe.config.comm import CommConfig
from moonep_moe.config.files import available_configs, load_config, packaged_configs_folder, read_config_yaml
from moonep_moe.config.models import (
    MoEConfig,
    RouterConfig,
    SharedExpertConfig,
    dtype_name,
    with_derived_defaults,
)

__all__ = [
    "CommConfig",
    "MoEConfig",
    "RouterConfig",
    "SharedExpertConfig",
    "available_configs",
    "dtype_name",
    "load_config",
    "packaged_configs_folder",
    "read_config_yaml",
    "with_derived_defaults",
]
