"""What every config model enforces (`CONFIG_RULES`)."""

from __future__ import annotations

from pydantic import ConfigDict

CONFIG_RULES = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
"""What every config model enforces: unknown keys are refused, a validated config is frozen, and float fields
take finite values only (a YAML ``.inf`` or ``.nan`` is refused, not stored). Int fields are declared
``StrictInt``, so that a bool is refused where an int is meant; ints given as YAML or Python ints pass."""
