"""Kernels: the speed that plain PyTorch cannot give, behind ops the model math calls (no model math here)."""


def build_all() -> None:
    """Build (or load from the cache: cheap) every C kernel now, at startup, not in a first request's forward pass;
    one that cannot be built is a warning and its ops' PyTorch forms run (build.load_or_warn)."""
    from engine.kernels import moe_experts, paged_attention  # (here: `build` and `operator` need neither)
    for module in (moe_experts, paged_attention):
        module.kernel()
