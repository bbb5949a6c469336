"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}, and in
Anthropic's, {"type": "error", "error": {"type", "message"}}, for everything under /v1/messages
(the Messages API; `error_response` picks the shape from the request's path).

Every failure a client can cause maps to one status code here; the handlers registered by
`install_error_handlers` make sure nothing reaches the client as a bare traceback or a
FastAPI-shaped `{"detail": ...}`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.frontend.client import DrainingError, EngineDeadError, QueueFullError
from pagedserve.server.limits import QUEUE_FULL_RETRY_AFTER_S

logger = logging.getLogger("pagedserve")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


# Anthropic's error types by status. A full queue is its 529 overloaded_error (what Anthropic's
# clients know to back off from and retry); other 503s (a dead engine, a drain) stay 503s.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_OVERLOADED = 529
_ANTHROPIC_PATH = "/v1/messages"


def is_anthropic_path(path: str | None) -> bool:
    return path is not None and (path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/"))


class APIError(Exception):
    """An error to return to the client as-is."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = err_type or _TYPES.get(status_code, "invalid_request_error")


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def anthropic_error(err: APIError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in the Messages API's shape. It has no `param`: the message
    names the field when it does not already."""
    status = ANTHROPIC_OVERLOADED if err.code == "queue_full" else err.status_code
    message = err.message
    if err.param is not None and err.param not in message:
        message = f"{err.param}: {message}"
    fallback = "api_error" if status >= 500 else "invalid_request_error"
    err_type = _ANTHROPIC_TYPES.get(status, fallback)
    return status, {"type": "error", "error": {"type": err_type, "message": message}}


def error_response(err: APIError, path: str | None = None) -> JSONResponse:
    """The error's response, in Anthropic's shape for a /v1/messages `path`, else OpenAI's."""
    headers = None
    if err.status_code == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif err.code == "queue_full":
        headers = {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
    if is_anthropic_path(path):
        status, body = anthropic_error(err)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code),
        status_code=err.status_code,
        headers=headers,
    )


def as_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to the error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, DrainingError):
        return APIError(503, str(exc), code="shutting_down")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    # ("body", "messages", 0, "role") -> "messages.0.role"
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


class ErrorMappingRoute(APIRoute):
    """A route whose exceptions all reach the client through the app's own handlers.

    Starlette sends the response of a handler registered for `Exception` from its outermost
    middleware and then re-raises: uvicorn logs "Exception in ASGI application" and closes the
    connection, so a keep-alive client may read a reset instead of the error. Here any other
    exception a route raises (a ValueError from a prompt check, a full queue, a dead engine, a
    bug) becomes an APIError first, which the inner exception middleware answers and keeps the
    connection open. Unexpected ones are logged once, by `as_api_error`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request):
            try:
                return await handler(request)
            except (APIError, RequestValidationError, StarletteHTTPException):
                raise
            except Exception as exc:
                raise as_api_error(exc) from exc

        return handle


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 in the OpenAI shape, refused
    from its Content-Length before it is read, or as soon as a chunked body passes the limit
    (the route then fails while reading it, and the HTTPException handler answers)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body ({size}) is larger than this server's limit of {self.max_bytes} "
            "bytes (--max-request-body-bytes)",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(self._error(f"{int(declared)} bytes"), scope.get("path"))
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException: FastAPI passes it on from its body parsing (which turns
                    # any other exception into a generic 400), and the handler below answers.
                    raise StarletteHTTPException(413, self._error(f"over {received} bytes").message)
            return message

        await self.app(scope, limited_receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_from_loc(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
        else:
            message = "; ".join(
                f"{_param_from_loc(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}"
                for e in errors
            )
        return error_response(APIError(400, message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_api_error(exc), request.url.path)
