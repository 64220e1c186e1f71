"""`python -m server`: build the engine, serve the app with uvicorn; SIGTERM drains gracefully."""

from __future__ import annotations

import logging
import sys

import uvicorn

from engine.engine import Engine
from server.app import create_app
from server.args import ServerArgs, parse_args
from server.async_engine import AsyncEngine
from server.graceful import GracefulServer
from server.metrics import Metrics
from server.state import ServerState

logger = logging.getLogger("server")


def build_state(args: ServerArgs) -> ServerState:
    engine = Engine(args.engine_args())
    metrics = Metrics(args.model_name, engine) if args.enable_metrics else None
    async_engine = AsyncEngine(engine, observer=metrics.observe if metrics else None,
                               on_submit=metrics.on_submit if metrics else None)
    return ServerState(args=args, engine=engine, async_engine=async_engine, metrics=metrics)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        state = build_state(args)
    except (ValueError, OSError) as e:  # bad flags, missing files, no tokenizer: say so, exit non-zero
        logger.error("cannot start: %s", e)
        print(f"error: cannot start the server: {e}", file=sys.stderr)
        return 2
    app = create_app(state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.shutdown_grace_period) + 5, access_log=False)
    GracefulServer(config, state).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
