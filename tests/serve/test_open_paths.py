"""With --api-key, /health and the /dashboard page stay open (the page holds no data; its polls of
/v1/stats need the key); no_logs is a known field on every generation route (no warning)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest

from serve_support import make_scripted_engine, start_server, stop_server

KEY = "sekrit"


@pytest.fixture(scope="module")
def keyed(tokenizer_factory):
    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                          ServeSettings(served_model_name="trnrt-tiny", api_key=KEY))
    yield server
    stop_server(server)


def get(server, path, key=None):
    req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_dashboard_and_health_open_stats_keyed(keyed):
    assert get(keyed, "/health")[0] == 200
    status, page = get(keyed, "/dashboard")
    assert status == 200 and b"<html" in page.lower()
    assert get(keyed, "/v1/stats")[0] == 401
    assert get(keyed, "/v1/stats", KEY)[0] == 200
    assert get(keyed, "/v1/models")[0] == 401


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "trnrt-tiny", "prompt": "hi", "max_tokens": 2, "no_logs": True}),
    ("/v1/chat/completions", {"model": "trnrt-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "no_logs": True}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "no_logs": True}),
])
def test_no_logs_is_known(keyed, caplog, path, body):
    req = urllib.request.Request(keyed.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with caplog.at_level(logging.WARNING):
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    assert not [r for r in caplog.records if "no_logs" in r.getMessage()]
