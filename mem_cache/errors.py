"""Exceptions of the token pools: builtin subclasses, so generic callers catch broadly while the HTTP layer maps
the precise class (exhausted -> retract/503, layer id -> 404, missing buffer -> 409, unknown buffer name -> 400)."""


class PoolExhaustedError(MemoryError):
    """Not enough free slots for an allocation. Callers should ask `can_alloc(n)` first."""


class KOnlyPoolError(NotImplementedError):
    """A value (V) accessor was called on `MHATokenToKOnlyPool`, which stores no V by design."""


class LayerIdError(ValueError):
    """A layer id outside the valid range; the message names the valid range."""


class MissingBufferError(LookupError):
    """A layer was asked for a buffer it does not have; the message says why and what to use instead."""

    def __init__(self, message: str, layer_id: int, buffer: str) -> None:
        super().__init__(message)
        self.layer_id, self.buffer = layer_id, buffer
