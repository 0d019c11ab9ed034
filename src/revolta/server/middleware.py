"""Pure-ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnect handling stay untouched):
API-key check on every route but /health, and request-id response headers for both SDKs."""

from __future__ import annotations

import hmac
import json
import uuid
from typing import Any

from .errors import anthropic_error_body, is_anthropic_path, openai_error_body

Scope = dict[str, Any]
_OPEN_PATHS = ("/health", "/ping")  # liveness probes need no key


class ServerMiddleware:
    def __init__(self, app: Any, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        extra = [(b"x-request-id", request_id.encode("latin-1")), (b"request-id", request_id.encode("latin-1"))]

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        path = scope.get("path", "")
        if self.api_key is not None and path not in _OPEN_PATHS and not self._authorized(headers):
            await self._reject(path, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _authorized(self, headers: dict[str, str]) -> bool:
        bearer = headers.get("authorization", "")
        given = bearer[7:].strip() if bearer.lower().startswith("bearer ") else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())  # type: ignore[union-attr]

    async def _reject(self, path: str, send: Any) -> None:
        message = "Invalid or missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        body = anthropic_error_body(401, message) if is_anthropic_path(path) else openai_error_body(401, message)
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})
