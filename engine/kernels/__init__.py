"""Kernels: the speed that plain PyTorch cannot give, behind ops the model math calls (no model math here)."""
