"""Triton kernels of the comm core (planner, row exchanges over peer pointer tables), compiled at first use."""
