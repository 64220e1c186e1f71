"""What every route needs, reachable as `request.app.state.server` (no module-level globals)."""

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from engine.runtime.engine import Engine
from server.args import ServerArgs
from server.async_engine import AsyncEngine


@dataclass
class ServerState:
    args: ServerArgs
    engine: Engine
    async_engine: AsyncEngine
    metrics: Any = None  # server.metrics.Metrics when --enable-metrics
    started: float = field(default_factory=time.time)
    ready: bool = False  # the app runs; /health answers 503 before

    @property
    def healthy(self) -> bool:
        ae = self.async_engine  # /health's 200: 503 while starting, warming up, and once draining
        return self.ready and ae.alive and not ae.warming and ae.accepting

    def status(self) -> str:
        if not self.async_engine.accepting:
            return "shutting_down"
        return "warming_up" if self.async_engine.warming else "ready" if self.healthy else "starting"


def server_state(request: Request) -> ServerState:
    return request.app.state.server
