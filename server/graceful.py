"""uvicorn with a graceful SIGTERM/SIGINT: drain the engine first, then let uvicorn shut down.

On the first signal: /health turns 503 and new generations get 503 at once; running requests get
`--shutdown-grace-period` seconds to finish, the rest are aborted (their clients still receive a
response with finish_reason abort); only then does uvicorn close its listeners and connections. The
process exits 0. A second SIGINT forces uvicorn's immediate exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from server.state import ServerState

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: runs as a Python signal handler on the main thread (the loop's thread), between two
        # bytecodes of whatever the loop was doing: only flag and schedule here. The signal is not
        # recorded in `_captured_signals`, so uvicorn will not re-raise it at exit: a drained
        # shutdown is a clean exit 0.
        if self._draining or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self.state.ready = False
        self.state.async_engine.accepting = False
        logger.info("received %s: draining (grace period %.1f s)", signal.Signals(sig).name,
                    self.state.args.shutdown_grace_period)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.async_engine.drain(self.state.args.shutdown_grace_period)
            await asyncio.sleep(0.2)  # let the last responses (aborts included) reach their clients
        except Exception:
            logger.exception("drain failed")
        finally:
            logger.info("drained: shutting down")
            self.should_exit = True
