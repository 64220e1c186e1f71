"""Small statistics and per-token timestamps shared by the benchmarks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float:
    """a / b, nan when either is missing or b is 0."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


@dataclass(frozen=True)
class TokenTimes:
    """One generation: its start time, the arrival time of every output token, and the tokens."""

    start: float
    token_times: tuple[float, ...]
    output_ids: tuple[int, ...]
    cached_tokens: int | None = None  # prompt tokens the engine reused from its prefix cache

    @property
    def n(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.start

    @property
    def total_s(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def e2e_tok_s(self) -> float:
        """All output tokens over the whole call (prefill included)."""
        return self.n / self.total_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time after the first: decode steps only."""
        span = self.token_times[-1] - self.token_times[0]
        return (self.n - 1) / span if self.n > 1 and span > 0 else math.nan
