"""`python -m server`: build the engine, serve the app with uvicorn; SIGTERM drains gracefully."""

from __future__ import annotations

import logging
import os
import sys

import torch
import uvicorn

from engine.engine import Engine
from server.app import create_app
from server.args import ServerArgs, parse_args
from server.async_engine import AsyncEngine
from server.graceful import GracefulServer
from server.metrics import Metrics
from server.state import ServerState

logger = logging.getLogger("server")


# TEST HOOK, off by default: with MINIMAX_TEST_FAULT_RID_PREFIX set, every request whose rid starts with
# that prefix fails inside the engine (as if its step had raised) once it has generated
# MINIMAX_TEST_FAULT_AFTER_TOKENS tokens (default 0). Only the reliability tests set it; never in production.
FAULT_PREFIX_ENV = "MINIMAX_TEST_FAULT_RID_PREFIX"
FAULT_AFTER_ENV = "MINIMAX_TEST_FAULT_AFTER_TOKENS"


def _test_fault_hook(prefix: str, after: int):
    def fault(req) -> None:
        if req.rid.startswith(prefix) and len(req.output_ids) >= after:
            raise RuntimeError(f"injected test fault for rid {req.rid}")
    return fault


def build_state(args: ServerArgs) -> ServerState:
    async_engine = AsyncEngine.launch(lambda: Engine(args.engine_args()))  # built on its own thread
    engine = async_engine.engine
    prefix = os.environ.get(FAULT_PREFIX_ENV)
    if prefix:
        after = int(os.environ.get(FAULT_AFTER_ENV, "0"))
        logger.warning("TEST HOOK ARMED: requests with a rid starting with %r fail after %d tokens (%s)",
                       prefix, after, FAULT_PREFIX_ENV)
        engine.fault_hook = _test_fault_hook(prefix, after)
    metrics = Metrics(args.model_name, engine) if args.enable_metrics else None
    if metrics is not None:
        async_engine.observer, async_engine.on_submit = metrics.observe, metrics.on_submit
    return ServerState(args=args, engine=engine, async_engine=async_engine, metrics=metrics)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads > 0:  # a process-wide setting: the engine thread's matmuls use it
        torch.set_num_threads(args.num_threads)
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
