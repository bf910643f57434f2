"""Error envelopes, one per API, and the handlers that render them.

Every failure the server reports goes through here: our own `APIError`s, Falcon's `HTTPError`s
(unknown route, wrong method) via the error serializer, and anything unexpected via a last-resort
handler that logs and answers 500 without a traceback.

Shapes (docs/API.md "Errors"):
- OpenAI (and the default for every route): `{"error": {"message", "type", "param", "code"}}`.
- SGLang's `/generate` contract check (an unknown `sampling_params` key, a wrong JSON type):
  `{"error": "<text>"}` (`SGLangContractError`), as SGLang 0.5.23's generated contract answers.
- SGLang's system aborts (queue full, shutdown) on `/generate`: `{"object": "error", "message",
  "type": "<status>", "param", "code"}` (`SGLangObjectError`).
SGLang's value errors (`{"error": {"message"}}`) are a subset of the OpenAI envelope, so they use it.
Messages never echo unescaped client bytes: `safe()` escapes what could not be encoded.
"""

from __future__ import annotations

import json
import logging

import falcon

log = logging.getLogger("trnrt.serve")

# OpenAI's error `type` per status; the client maps statuses to exception classes on its own.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def safe(text: str) -> str:
    """`text` with anything that is not encodable UTF-8 (lone surrogates) escaped."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI error envelope as a dict."""
    return {
        "error": {
            "message": safe(message),
            "type": type_ or _TYPE_BY_STATUS.get(status, "invalid_request_error"),
            "param": safe(param) if isinstance(param, str) else param,
            "code": code if code is not None else status,
        }
    }


class APIError(Exception):
    """An error answered with `status` in the OpenAI envelope. `param` names the offending field.

    Subclasses render other APIs' envelopes (`to_dict`); the status and message are the same idea.
    """

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = dict(headers or {})  # extra response headers (e.g. QUEUE_FULL_HEADERS)

    def to_dict(self) -> dict:
        return error_body(self.status, self.message, self.param, self.type, self.code)

    @staticmethod
    def handle(req, resp, ex: "APIError", params) -> None:
        resp.status = ex.status
        resp.content_type = falcon.MEDIA_JSON
        resp.text = json.dumps(ex.to_dict(), ensure_ascii=False)
        if ex.status == 401:
            resp.set_header("WWW-Authenticate", "Bearer")
        for k, v in ex.headers.items():
            resp.set_header(k, v)


# The name every OpenAI route uses; the envelope is the default one.
OpenAIError = APIError


class SGLangContractError(APIError):
    """SGLang's contract violation: `{"error": "<text>"}` (the text names the field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message, param)

    def to_dict(self) -> dict:
        return {"error": safe(self.message)}


class SGLangObjectError(APIError):
    """SGLang's HTTPException envelope for system aborts: `{"object": "error", ...}` (SGLang's
    OpenAI routes answer them in the same shape, their ErrorResponse)."""

    def to_dict(self) -> dict:
        return {"object": "error", "message": safe(self.message), "type": str(self.status), "param": self.param,
                "code": self.status}


# Anthropic's error `type` per status (its documented table; any other 4xx is invalid_request_error).
ANTHROPIC_TYPE_BY_STATUS = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class AnthropicError(APIError):
    """Anthropic's envelope, for the Messages routes: `{"type": "error", "error": {"type", "message"}}`
    (the message names the field; `param` is kept for logs and tests, not sent)."""

    @property
    def anthropic_type(self) -> str:
        if self.status in ANTHROPIC_TYPE_BY_STATUS:
            return ANTHROPIC_TYPE_BY_STATUS[self.status]
        return "invalid_request_error" if self.status < 500 else "api_error"

    def to_dict(self) -> dict:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": safe(self.message)}}

    @classmethod
    def of(cls, err: APIError) -> "AnthropicError":
        """Any APIError (shared readers, admission, system aborts) re-shaped for Anthropic's routes."""
        if isinstance(err, cls):
            return err
        return cls(err.status, err.message, err.param, code=err.code, headers=err.headers)


# SGLang 0.5.23's messages for a request the engine could not queue (503 system aborts).
QUEUE_FULL_MESSAGE = "The request queue is full."
DISPLACED_MESSAGE = "The request is aborted by a higher priority request."
QUEUE_FULL_MESSAGES = (QUEUE_FULL_MESSAGE, DISPLACED_MESSAGE)
# Marks a 503 that means "alive but full, retry" (engine queue full, a waiting request displaced,
# the HTTP layer at capacity), so a router can tell it from a dead or stopping engine.
QUEUE_FULL_HEADERS = {"Retry-After": "1", "X-Trnrt-Queue-Full": "1"}
# SGLang's refusal of a `priority` under --abort-on-priority-when-disabled.
PRIORITY_DISABLED_MESSAGE = "Using priority is disabled for this server. Please send a new request without a priority."


def system_abort(status: int, message: str) -> SGLangObjectError:
    """A system abort (a finish with a status code) as SGLang answers it, on every generation
    route: `{"object": "error", "message", "type": "<status>", "param": null, "code": <status>}`,
    with QUEUE_FULL_HEADERS when the engine could not queue the request."""
    headers = QUEUE_FULL_HEADERS if status == 503 and message in QUEUE_FULL_MESSAGES else None
    return SGLangObjectError(status, message, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def unsupported(param: str, why: str = "is not supported by this server yet") -> APIError:
    """A field the engine cannot serve: refused by name rather than silently ignored."""
    return APIError(400, f"{param} {why}", param, code="unsupported_parameter")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable")


def serialize_http_error(req, resp, exception: falcon.HTTPError) -> None:
    """Falcon's own errors (404 route, 405 method, ...) in the OpenAI envelope."""
    status = exception.status_code
    message = exception.title or str(status)
    if exception.description:
        message = f"{message}: {exception.description}"
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(error_body(status, message), ensure_ascii=False)


def handle_unexpected(req, resp, ex: Exception, params) -> None:
    """Last resort: log with traceback, answer 500 without one. Any hit here is a bug to fix."""
    if isinstance(ex, (falcon.HTTPError, falcon.HTTPStatus)):
        raise ex  # Falcon's own handlers render these
    log.exception("unhandled error on %s %s", req.method, safe(req.path))
    resp.status = 500
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(error_body(500, f"Internal server error: {type(ex).__name__}"))


def register(app: falcon.App) -> None:
    """Install the handlers on `app` (most specific wins in Falcon >= 3)."""
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(APIError, APIError.handle)
    app.set_error_serializer(serialize_http_error)
