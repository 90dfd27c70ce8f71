"""Triton kernels of the comm core (planner, row exchanges through peer pointer tables)."""
