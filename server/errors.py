"""The two error envelopes: native `{"error": {"message"}}` and OpenAI's flat ErrorResponse (/v1/*)."""

import json

from fastapi import Request
from fastapi.responses import JSONResponse

OPENAI_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, extra: dict | None = None, logged: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra or {}
        self.logged = logged  # True once the request's access-log line is written


class BadRequest(ApiError):
    """Invalid client input (a 400 naming the field): a validator's ValueError where it is called; other ones: 500."""

    def __init__(self, message: str, extra: dict | None = None) -> None:
        super().__init__(400, message, extra)


def media_type(content_type: str) -> str:
    """'Application/JSON; charset=utf-8' -> 'application/json'."""
    return content_type.split(";", 1)[0].strip().lower()


def not_json_message(content_type: str) -> str:
    return f"Content-Type must be application/json, got {content_type or 'none'!r}."


def error_body(path: str, status: int, message: str, extra: dict | None = None) -> dict:
    if path.startswith("/v1/"):  # the OpenAI routes
        return {"object": "error", "message": message, "type": OPENAI_TYPES.get(status, str(status)),
                "param": None, "code": status} | (extra or {})
    return {"error": {"message": message} | (extra or {})}


def error_response(request: Request | str, status: int, message: str, extra: dict | None = None,
                   headers: dict | None = None) -> JSONResponse:
    path = request if isinstance(request, str) else request.url.path
    return JSONResponse(error_body(path, status, message, extra), status_code=status, headers=headers)


def sse_error(path: str, status: int, message: str) -> str:
    """An error as a stream frame, once a stream has begun: the path's envelope under "error"."""
    body = error_body(path, status, message)
    inner = body["error"] | {"code": status} if "error" in body else {k: v for k, v in body.items() if k != "object"}
    return f"data: {json.dumps({'error': inner}, ensure_ascii=False)}\n\n"
