"""Config files: the YAML configs packaged with moonep-moe (`moonep_moe/configs`) and the user's own, read
into the pydantic models with one-line errors naming the file, the line and the field. A key given twice in
one mapping is an error (`UniqueKeyLoader`), where YAML loaders let the last one win silently."""

from __future__ import annotations

import os
from collections.abc import Hashable
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

import yaml

from moonep_moe.config.models import MoEConfig

ConfigKind = Literal["layer", "train"]
"""What a config YAML describes: ``"layer"``, the fields of one ``MoEConfig`` (``load_config``, ``moonep-moe
demo``); ``"train"``, a training run with top-level ``model:`` / ``moe:`` / ``train:`` sections
(``moonep_moe.apps.train.load_train_config``, ``moonep-moe train``)."""


_KIND_NAMES = {"layer": "layer config", "train": "training config"}


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping, naming the key and both lines (the
    YAML spec requires unique keys; PyYAML keeps the last value without a word). Keys brought in by a
    ``<<`` merge may still be overridden, as YAML means them to be."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base class refuses it, with its own message
            if key in first_lines:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first_lines[key]}); give each key "
                    f"once", key_node.start_mark)
            first_lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """The YAML document in `text`, read with `UniqueKeyLoader` (safe tags only, keys unique)."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def packaged_configs_folder() -> Traversable:
    """The packaged YAML configs' folder, ``moonep_moe/configs`` (the repo-root ``configs/`` links to it)."""
    return resources.files("moonep_moe") / "configs"


def _config_kind(data: dict[str, Any]) -> ConfigKind:
    """The kind of a config's YAML mapping: ``"train"`` if it has a ``model:`` or ``train:`` section."""
    return "train" if "model" in data or "train" in data else "layer"


def available_configs(kind: ConfigKind = "layer") -> list[str]:
    """Names of the packaged configs of ``kind`` (``moonep_moe/configs/<name>.yaml``), sorted. Layer and
    training configs share the folder."""
    files = [p for p in packaged_configs_folder().iterdir() if p.name.endswith(".yaml")]
    return sorted(p.name.removesuffix(".yaml") for p in files
                  if _config_kind(parse_yaml(p.read_text(encoding="utf-8")) or {}) == kind)


def _is_bare_name(path_or_name: str) -> bool:
    return (
        not path_or_name.endswith((".yaml", ".yml"))
        and "/" not in path_or_name
        and os.sep not in path_or_name
    )


def _read_yaml_text(path_or_name: str | os.PathLike, kind: ConfigKind) -> tuple[str, str]:
    """Return (YAML text, source description) for a path or a packaged config name."""
    if isinstance(path_or_name, str) and _is_bare_name(path_or_name):
        packaged = packaged_configs_folder() / f"{path_or_name}.yaml"
        if not packaged.is_file():
            raise FileNotFoundError(
                f"no packaged {_KIND_NAMES[kind]} named {path_or_name!r}; available: "
                f"{', '.join(available_configs(kind))} (or pass a path to a .yaml file)"
            )
        return packaged.read_text(encoding="utf-8"), f"packaged config {path_or_name!r}"
    path = Path(path_or_name)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {str(path)!r}")
    return path.read_text(encoding="utf-8"), str(path)


def _yaml_syntax_error(source: str, error: yaml.YAMLError) -> ValueError:
    """One line naming the file, and the line and column where yaml gives them (1-based)."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return ValueError(f"{source}: invalid YAML: {' '.join(str(error).split())}")
    context = f" ({error.context})" if error.context else ""
    return ValueError(f"{source}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: "
                      f"{error.problem}{context}")


def read_config_yaml(path_or_name: str | os.PathLike,
                     kind: ConfigKind = "layer") -> tuple[dict[str, Any], str]:
    """The mapping in a config YAML of ``kind`` and where it came from (``"packaged config 'tiny-cpu'"`` or
    the path, for messages). ``path_or_name`` is a path, or a bare name without ".yaml" and without a path
    separator, which resolves to the packaged ``moonep_moe/configs/<name>.yaml``.

    Raises:
        FileNotFoundError: unknown packaged name (the message lists those of ``kind``) or missing file.
        ValueError (one line, naming the file): a YAML syntax error or a key given twice (with its line and
            column), not a mapping, or a config of the other kind.
    """
    text, source = _read_yaml_text(path_or_name, kind)
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as error:
        raise _yaml_syntax_error(source, error) from error
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a YAML mapping of {_KIND_NAMES[kind]} fields, "
                         f"got {type(data).__name__}")
    if _config_kind(data) != kind:
        raise ValueError(f"{source} is a {_KIND_NAMES[_config_kind(data)]}, not a {_KIND_NAMES[kind]}; "
                         f"packaged {_KIND_NAMES[kind]}s: {', '.join(available_configs(kind))}")
    return data, source


def load_config(path_or_name: str | os.PathLike, **overrides: Any) -> MoEConfig:
    """Load and validate a ``MoEConfig`` from YAML.

    Args:
        path_or_name: a path to a YAML file, or a bare name without ".yaml" and without a path separator
            (``"tiny-cpu"``, ``"deepseek-v3"``), which resolves to the packaged
            ``moonep_moe/configs/<name>.yaml`` (the repo-root ``configs/`` is the same folder).
        **overrides: top-level ``MoEConfig`` fields applied to the YAML mapping before validation, e.g.
            ``load_config("tiny-cpu", ep_size=2)``. A dict given for a nested field (``router``,
            ``shared_experts``) is merged into the YAML's dict, so ``router={"aux_loss_coeff": 0.01}``
            keeps the other router keys.

    Returns:
        The validated, frozen config.

    Raises:
        FileNotFoundError: unknown packaged name (the message lists the available names) or missing file.
        ValueError: a YAML syntax error, not a mapping, or a training config (one line naming the file; see
            ``read_config_yaml``).
        pydantic.ValidationError: a field is missing, unknown or invalid; the message names it.
    """
    data, _ = read_config_yaml(path_or_name, "layer")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return MoEConfig.model_validate(data)
