"""`python -m server`: take the port, build the engine, serve the app with uvicorn; SIGTERM drains. On the first
SIGTERM/SIGINT /health turns 503 and new generations get 503 at once; running requests get `--shutdown-grace-period`
seconds to finish, the rest are aborted (their clients still get a response, finish_reason abort); only then does
uvicorn close its listeners and connections. The process exits 0. A second SIGINT forces uvicorn's immediate exit."""

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn

from engine.runtime.engine import Engine
from server.app import create_app
from server.args import ServerArgs, parse_args
from server.async_engine import AsyncEngine
from server.metrics import Metrics
from server.state import ServerState

logger = logging.getLogger("server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state, self._draining = state, False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: a signal handler on the loop's (main) thread, between two bytecodes of whatever it was doing: only flag
        # and schedule here. Not in `_captured_signals`, so uvicorn does not re-raise it: a drained shutdown exits 0.
        if self._draining or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        logger.info("received %s: draining (grace period %.1f s)", signal.Signals(sig).name,
                    self.state.args.shutdown_grace_period)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.async_engine.drain(self.state.args.shutdown_grace_period)
            await asyncio.sleep(0.2)  # let the last responses (aborts included) reach their clients
        except Exception:
            logger.exception("drain failed")
        finally:
            logger.info("drained: shutting down")
            self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """Take the port before the model loads, so one in use fails at once, naming it. NOTE: uvicorn binds it itself once
    this socket is closed (one handed to it resets connections sending a body past an early response, e.g. a 413)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror} (is another server using port {port}? "
                      "pass --port to choose another)") from None
    return sock


def build_state(args: ServerArgs) -> ServerState:
    async_engine = AsyncEngine(lambda: Engine(args.engine), args.max_batch_size)  # built on the engine thread
    metrics = Metrics(args.model_name, async_engine.engine) if args.enable_metrics else None
    if metrics is not None:
        async_engine.observer, async_engine.on_submit = metrics.observe, metrics.on_submit
    return ServerState(args=args, engine=async_engine.engine, async_engine=async_engine, metrics=metrics)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock, state = bind(args.host, args.port), build_state(args)
    except (ValueError, OSError) as e:  # port taken, bad flags, missing files, no tokenizer: exit non-zero
        logger.error("cannot start: %s", e)
        print(f"error: cannot start the server: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=int(args.shutdown_grace_period) + 5)
    sock.close()
    GracefulServer(config, state).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
