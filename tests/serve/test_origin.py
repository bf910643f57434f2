"""Cross-origin requests and foreign Host names are refused (a web page must not drive a local server)."""

from __future__ import annotations

import pytest

from serve_support import make_scripted_engine

BODY = {"model": "trnrt-tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def bound_server(tokenizer_factory):
    """A server that knows its bind host (what `trnrt serve` sets), with one allowed origin."""
    from serve_support import Server
    from trnrt.serve import ServeSettings, create_app
    from trnrt.serve.server import make_server, start_in_thread, stop_in_thread

    engine = make_scripted_engine(tokenizer_factory)
    settings = ServeSettings(served_model_name="trnrt-tiny", bind_host="127.0.0.1",
                             allowed_origins=("http://dashboard.example:8080",))
    app = create_app(engine, tokenizer_factory, settings)
    srv = make_server(app, host="127.0.0.1", port=0)
    thread = start_in_thread(srv)
    yield Server(url=f"http://127.0.0.1:{srv.effective_port}", port=srv.effective_port, engine=engine, app=app,
                 srv=srv, thread=thread)
    engine.shutdown(0.0)
    stop_in_thread(srv, thread)


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://localhost"])
def test_foreign_origin_post_is_refused(bound_server, origin):
    for ctype in ("application/json", "text/plain"):
        status, data, _ = bound_server.raw("POST", "/v1/completions", BODY,
                                           headers={"Origin": origin, "Content-Type": ctype})
        assert status == 403 and data["error"]["param"] == "Origin", data


def test_same_origin_and_allowed_origin_are_served(bound_server):
    own = f"http://127.0.0.1:{bound_server.port}"
    for origin in (own, "http://dashboard.example:8080"):
        status, data, headers = bound_server.raw("POST", "/v1/completions", BODY, headers={"Origin": origin})
        assert status == 200, data
        assert headers.get("Access-Control-Allow-Origin") == origin


def test_preflight(bound_server):
    status, _, headers = bound_server.raw("OPTIONS", "/v1/completions", None,
                                          headers={"Origin": "http://dashboard.example:8080",
                                                   "Access-Control-Request-Method": "POST"})
    assert status == 204 and "POST" in headers["Access-Control-Allow-Methods"]
    status, data, _ = bound_server.raw("OPTIONS", "/v1/completions", None, headers={"Origin": "http://evil.example"})
    assert status == 403, data


@pytest.mark.parametrize("host", ["evil.example", "evil.example:30000", "10.0.0.1"])
def test_foreign_host_is_refused(bound_server, host):
    status, data, _ = bound_server.raw("GET", "/v1/models", None, headers={"Host": host})
    assert status == 403 and data["error"]["param"] == "Host", data


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:1234", "[::1]:30000"])
def test_loopback_hosts_are_served(bound_server, host):
    status, data, _ = bound_server.raw("GET", "/v1/models", None, headers={"Host": host})
    assert status == 200, data


def test_no_origin_no_problem(bound_server):
    status, data, _ = bound_server.raw("POST", "/v1/completions", BODY)
    assert status == 200, data
