"""`Authorization: Bearer <key>` on every route but /health (as SGLang exempts it)."""

from __future__ import annotations

import hmac

from trnrt.serve.http.errors import OpenAIError

class AuthMiddleware:
    """`Authorization: Bearer <key>` on every route but /health (as SGLang exempts it)."""

    def __init__(self, api_key: str):
        self._key = api_key.encode()

    def process_request(self, req, resp) -> None:
        if req.path == "/health":
            return
        header = req.get_header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise OpenAIError(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                              type_="authentication_error", code="invalid_api_key")


class InFlightMiddleware:
    """Counts requests inside a handler (ServeState.http_enter/http_leave) for graceful shutdown."""

    def __init__(self, state):
        self.state = state

    def process_request(self, req, resp) -> None:
        self.state.http_enter()
        req.context.trnrt_counted = True

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        if getattr(req.context, "trnrt_counted", False):
            req.context.trnrt_counted = False
            self.state.http_leave()
