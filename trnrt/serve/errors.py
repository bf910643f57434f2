"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every failure the server reports goes through here: our own `OpenAIError`s, Falcon's `HTTPError`s
(unknown route, wrong method) via the error serializer, and anything unexpected via a last-resort
handler that logs and answers 500 without a traceback.
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
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI error envelope as a dict."""
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPE_BY_STATUS.get(status, "invalid_request_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


class OpenAIError(Exception):
    """An error answered with `status` and the OpenAI envelope. `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def to_dict(self) -> dict:
        return error_body(self.status, self.message, self.param, self.type, self.code)

    @staticmethod
    def handle(req, resp, ex: "OpenAIError", params) -> None:
        resp.status = ex.status
        resp.content_type = falcon.MEDIA_JSON
        resp.text = json.dumps(ex.to_dict(), ensure_ascii=False)
        if ex.status == 401:
            resp.set_header("WWW-Authenticate", "Bearer")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def unsupported(param: str, why: str = "is not supported by this server yet") -> OpenAIError:
    """A field the engine cannot serve: refused by name rather than silently ignored."""
    return OpenAIError(400, f"{param} {why}", param, code="unsupported_parameter")


def serialize_http_error(req, resp, exception: falcon.HTTPError) -> None:
    """Falcon's own errors (404 route, 405 method, ...) in the same envelope."""
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
    log.exception("unhandled error on %s %s", req.method, req.path)
    resp.status = 500
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(error_body(500, f"Internal server error: {type(ex).__name__}"))


def register(app: falcon.App) -> None:
    """Install the handlers on `app` (most specific wins in Falcon >= 3)."""
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(OpenAIError, OpenAIError.handle)
    app.set_error_serializer(serialize_http_error)
