"""`operator`: a kernel's Python entry point registered as the torch operator `minimax::<name>`, which eager code and
compiled graphs call alike (in a graph an opaque extern call, its output shaped like its first argument). NOTE: through
`torch.library.Library` (the function is the op's kernel for every backend), not `torch.library.custom_op`, whose layers
(autograd, aliasing checks) cost ~13 us a call, 17 a decode step past batch 1. No autograd formula."""

from collections.abc import Callable

import torch

Kernel = Callable[..., torch.Tensor]
_LIBRARY = torch.library.Library("minimax", "DEF")  # (the operator namespace: one per process, as torch's own)


def operator(schema: str, fake: Kernel | None = None) -> Callable[[Kernel], Callable]:
    """Decorate a kernel's entry point with its schema, e.g. "moe_experts(Tensor x, float alpha) -> Tensor";
    the result is the operator (`torch.ops.minimax.<name>.default`). `fake`: its output's shape (default: x's)."""
    name = schema.split("(", 1)[0]

    def register(fn: Kernel) -> Callable:
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"minimax::{name}", fake or (lambda x, *_: torch.empty_like(x)), lib=_LIBRARY)
        op = getattr(torch.ops.minimax, name).default
        op.__doc__ = fn.__doc__
        return op

    return register


def require(ok: bool, what: str, *got: object) -> None:
    """A ValueError unless `ok`: what an op needs (`what`) and what it got (tensors by dtype and shape)."""
    if not ok:
        raise ValueError(f"{what}; got " + ", ".join(f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                                                      else repr(t) for t in got))
