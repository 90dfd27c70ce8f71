"""Swapping the MoE blocks of existing models for `MoonEPMoELayer` (`hf`: Hugging Face transformers)."""
