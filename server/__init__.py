"""The HTTP server: FastAPI app, routes, the async bridge to the engine thread, metrics."""

__version__ = "0.1.0"
