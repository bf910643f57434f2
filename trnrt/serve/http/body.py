"""Reading a request body: size limits, JSON parsing, a 4xx naming what is wrong."""

from __future__ import annotations

import json

from trnrt.serve.http.errors import OpenAIError, bad_request, safe


def check_json_content_type(req) -> None:
    ctype = (req.content_type or "").strip()
    mime, _, params = ctype.partition(";")
    if mime.strip().lower() != "application/json":
        raise OpenAIError(415, f"Content-Type must be application/json, got {safe(ctype)!r}", "Content-Type")
    for p in params.split(";"):
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise OpenAIError(415, f"the body must be UTF-8 JSON, got charset {safe(v.strip())!r}", "Content-Type")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(req, max_bytes: int) -> dict:
    """The request body as a JSON object, or a 400/413/415 naming what is wrong.

    The Content-Type must be `application/json` (charset, if given, utf-8), as SGLang requires:
    a browser can send a cross-origin text/plain or form POST without a preflight, never a JSON
    one, so this also keeps web pages from driving a local server.
    """
    check_json_content_type(req)
    length = req.content_length
    if length is not None and length > max_bytes:
        raise OpenAIError(413, f"Request body too large: {length} bytes (limit {max_bytes}).")
    data = req.bounded_stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OpenAIError(413, f"Request body too large (limit {max_bytes} bytes).")
    if not data.strip():
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        # Decode as UTF-8 first: json.loads(bytes) would accept UTF-16 and UTF-32 bodies too.
        body = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("Request body is not valid UTF-8.")
    except (ValueError, RecursionError) as e:
        raise bad_request(f"Could not parse JSON body: {e}")
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return body
