"""`python -m server`: take the port, build the engine, serve the app with uvicorn; SIGTERM drains."""

from __future__ import annotations

import logging
import socket
import sys

import torch
import uvicorn

from engine.runtime.engine import Engine
from server.app import create_app
from server.args import ServerArgs, parse_args
from server.async_engine import AsyncEngine
from server.graceful import GracefulServer
from server.metrics import Metrics
from server.state import ServerState

logger = logging.getLogger("server")


def bind(host: str, port: int) -> socket.socket:
    """Take the port before the model loads, so a port in use fails at once, naming it.

    NOTE: uvicorn binds the port itself once this socket is closed (a socket handed to it
    resets connections that send a body past an early response, e.g. a 413).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    try:
        sock = bind(args.host, args.port)
        state = build_state(args)
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
