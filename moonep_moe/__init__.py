"""moonep-moe: an expert-parallel MoE layer for PyTorch with MoonEP-style dynamic redundant experts."""

__version__ = "0.1.0"
