"""Liveness and observability routes: /health, /v1/stats, /metrics."""

from __future__ import annotations

import json

import falcon

from trnrt.serve.http.state import ServeState


class Health:
    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        self.state.check_accepting()
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = ""


class Stats:
    """GET /v1/stats: the engine's live snapshot, as the engine reports it."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.text = json.dumps(self.state.engine.stats(), ensure_ascii=False)


class Metrics:
    """GET /metrics: the /v1/stats figures in a Prometheus exposition format (trnrt.stats.prometheus).

    One snapshot per scrape, rendered by prometheus_client; the format and its content type come
    from prometheus_client's `choose_encoder` for the request's Accept header (text 0.0.4 by default,
    OpenMetrics or text 1.0.0 when a scraper asks), as prometheus_client's own WSGI app does.
    Needs the API key when one is set, like /v1/stats (docs/API.md).
    """

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        from prometheus_client.exposition import choose_encoder
        from prometheus_client.registry import CollectorRegistry

        from trnrt.stats.prometheus import SnapshotCollector

        snapshot = self.state.engine.stats()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(lambda: snapshot))
        encoder, content_type = choose_encoder(req.get_header("Accept") or "")
        resp.content_type = content_type
        resp.data = encoder(registry)
