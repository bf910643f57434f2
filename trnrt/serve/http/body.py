"""Reading a request body: size limits, JSON parsing, a 4xx naming what is wrong."""

from __future__ import annotations

import json

from trnrt.serve.http.errors import OpenAIError, bad_request

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(req, max_bytes: int) -> dict:
    """The request body as a JSON object, or a 400/413 naming what is wrong.

    The Content-Type is not checked (curl's default form type is common); the body must be JSON.
    """
    length = req.content_length
    if length is not None and length > max_bytes:
        raise OpenAIError(413, f"Request body too large: {length} bytes (limit {max_bytes}).")
    data = req.bounded_stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OpenAIError(413, f"Request body too large (limit {max_bytes} bytes).")
    if not data.strip():
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("Request body is not valid UTF-8.")
    except (ValueError, RecursionError) as e:
        raise bad_request(f"Could not parse JSON body: {e}")
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return body
