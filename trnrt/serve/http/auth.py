"""`Authorization: Bearer <key>` on every route but /health (as SGLang exempts it) and the
/dashboard page (it holds no data: its polls of /v1/stats carry the key)."""

from __future__ import annotations

import hmac

from trnrt.serve.http.errors import AnthropicError, OpenAIError

# /health (SGLang exempts it) and the /dashboard page, static HTML with no data in it: a browser
# cannot send a header to open it, and its polls of /v1/stats carry the key (/dashboard#key=KEY).
_OPEN_PATHS = frozenset({"/health", "/dashboard"})


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every route but /health (as SGLang exempts it).

    `admin_paths` are SGLang's "admin-optional" routes (/flush_cache, /abort_request): with an
    `admin_api_key` they need that key and only that key (SGLang does not accept --api-key there
    once --admin-api-key is set); without one they need `api_key` like every other route. Other
    routes need `api_key` when it is set and are open otherwise, whatever `admin_api_key` is
    (SGLang's rule, srt/utils/auth.py).
    """

    def __init__(self, api_key: str | None, admin_api_key: str | None = None, admin_paths=(), anthropic_paths=()):
        self._key = api_key.encode() if api_key else None
        self._admin_key = admin_api_key.encode() if admin_api_key else None
        self._admin_paths = frozenset(admin_paths)
        # Anthropic's routes also take `x-api-key: <key>` (Claude Code, curl examples; the SDK
        # sends the Bearer form) and answer 401 in Anthropic's envelope. Other routes: unchanged.
        # `anthropic_paths`: those routes and every path under them.
        self._anthropic_prefixes = tuple(anthropic_paths) + tuple(p.rstrip("/") + "/" for p in anthropic_paths)

    def process_request(self, req, resp) -> None:
        if req.path in _OPEN_PATHS:
            return
        key = self._key
        if self._admin_key is not None and req.path in self._admin_paths:
            key = self._admin_key
        if key is None:
            return
        header = req.get_header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return
        if self._anthropic_prefixes and (req.path in self._anthropic_prefixes
                                         or req.path.startswith(self._anthropic_prefixes)):
            x_key = req.get_header("x-api-key")
            if x_key is not None and hmac.compare_digest(x_key.strip().encode(), key):
                return
            raise AnthropicError(401, "Invalid or missing API key (x-api-key: <key> or Authorization: Bearer <key>).",
                                 code="invalid_api_key")
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
