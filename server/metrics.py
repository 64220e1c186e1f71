"""Placeholder: Prometheus metrics come in the next step."""

from __future__ import annotations

from typing import Any


class Metrics:
    def __init__(self, model_name: str, engine: Any) -> None:
        self.model_name, self.engine = model_name, engine

    def observe(self, out: Any, now: float) -> None:
        pass
