"""One error layer for every route: exceptions -> status -> the envelope the path's clients expect.

OpenAI routes answer {"error": {message, type, param, code}} (vLLM's form: `code` is the HTTP status);
/v1/messages* answers {"type": "error", "error": {type, message}} with `type` derived from the status
exactly as the 0.1.3 release note lists. Client mistakes are 4xx, never 5xx: SDKs retry 5xx twice.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_OPENAI_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                 404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                 422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
                 501: "NotImplementedError", 503: "ServiceUnavailableError"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


class APIError(Exception):
    """A request that cannot be served, with the HTTP status and (OpenAI) `param` to report."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def anthropic_error_type(status: int) -> str:
    """The release note's status -> error.type mapping (also used for errors inside streams)."""
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/").startswith("/v1/messages")


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "BadRequestError" if status < 500
                                                                     else "InternalServerError"),
                      "param": param, "code": status}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def error_response(path: str, status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = anthropic_error_body(status, message) if is_anthropic_path(path) else \
        openai_error_body(status, message, param)
    return JSONResponse(body, status_code=status, headers=headers)


def sanitize(message: str) -> str:
    """Drop memory addresses and absolute paths from a message that goes to a client."""
    message = re.sub(r" at 0x[0-9a-fA-F]+", "", message)
    return re.sub(r"(/[\w.\-]+){2,}/", "", message)


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic errors as one readable line (no Python repr) and the first offending field."""
    parts, first = [], None
    for err in errors[:10]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        first = first or (loc.split(".")[0] if loc else None)
        msg = str(err.get("msg", "is invalid"))[:200]
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "Invalid request: " + "; ".join(parts), first


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure (ours, FastAPI's, Starlette's, unexpected) through the path-aware envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"There is no route {request.method} {request.url.path}"
        return error_response(request.url.path, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(request.url.path, 500, f"Internal server error: {sanitize(str(exc)) or type(exc).__name__}")
