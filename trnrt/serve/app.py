"""The route table: `create_app(engine_client, tokenizer_factory, settings) -> falcon.App`.

Only wiring lives here (nothing imports this module but the package's lazy exports): the route
families are in handlers/ (one module each), which parse with protocol/, render with output/ and
share http/ (state, auth, bodies, SSE, error envelopes). Import order, enforced by import-linter:
app -> handlers -> protocol | output -> http.
"""

from __future__ import annotations

from typing import Callable

import falcon

from trnrt.engine.core.client import EngineClient
from trnrt.serve import dashboard
from trnrt.serve.handlers import admin, anthropic, generate, info, openai, tokenize
from trnrt.serve.handlers import responses as responses_api
from trnrt.serve.http import errors
from trnrt.serve.http.auth import AuthMiddleware, InFlightMiddleware
from trnrt.serve.http.origin import OriginMiddleware
from trnrt.serve.http.state import ServeSettings, ServeState, get_state  # noqa: F401 (exported)


class ServeApp(falcon.App):
    """falcon.App (which uses __slots__) plus a place for the ServeState."""

    serve_state: ServeState


def create_app(engine_client: EngineClient, tokenizer_factory: Callable[[], object],
               settings: ServeSettings | None = None) -> falcon.App:
    """Build the WSGI app.

    Args:
        engine_client: anything satisfying trnrt.engine.core.client.EngineClient.
        tokenizer_factory: returns a fresh HF tokenizer; called once per waitress thread.
        settings: ServeSettings (defaults if None).

    The app's ServeState is `app.serve_state` (`get_state(app)`; server.py uses it for admission
    and shutdown).
    """
    settings = settings or ServeSettings()
    state = ServeState(engine_client, tokenizer_factory, settings)
    # The in-flight counter first, so a request refused by auth is counted and uncounted too.
    middleware = [InFlightMiddleware(state),
                  OriginMiddleware(tuple(settings.allowed_origins), settings.allowed_hosts, settings.bind_host)]
    if settings.api_key or settings.admin_api_key:
        middleware.append(AuthMiddleware(settings.api_key, settings.admin_api_key, admin.ADMIN_PATHS,
                                         anthropic_paths=(anthropic.MESSAGES_PATH,)))
    app = ServeApp(middleware=middleware)
    app.serve_state = state
    errors.register(app)
    routes = {
        "/health": info.Health(state),
        "/v1/stats": info.Stats(state),
        "/metrics": info.Metrics(state),
        **dashboard.routes(),  # GET /dashboard: a self-contained page polling /v1/stats
        # OpenAI
        "/v1/models": openai.Models(state),
        "/v1/models/{model_id:path}": openai.Model(state),
        "/v1/completions": openai.Completions(state),
        "/v1/chat/completions": openai.ChatCompletions(state),
        # Anthropic Messages (/v1/messages, /v1/messages/count_tokens, 404 for the rest under it)
        **anthropic.routes(state),
        **responses_api.routes(state),  # /v1/responses (+ {id}, {id}/cancel with the response store)
        # Tokenizer routes (SGLang serves both spellings; vLLM the bare ones): request thread only
        "/tokenize": (tok := tokenize.Tokenize(state)),
        "/v1/tokenize": tok,
        "/detokenize": (detok := tokenize.Detokenize(state)),
        "/v1/detokenize": detok,
        # SGLang native
        "/generate": generate.Generate(state),
        # Admin and info (SGLang's current names, then its deprecated aliases)
        "/model_info": admin.ModelInfo(state),
        "/get_model_info": admin.ModelInfo(state, alias="/get_model_info"),
        "/server_info": admin.ServerInfo(state),
        "/get_server_info": admin.ServerInfo(state, alias="/get_server_info"),
        "/v1/loads": admin.Loads(state),
        "/get_load": admin.GetLoad(state),
        "/health_generate": admin.HealthGenerate(state),
        "/abort_request": admin.AbortRequest(state),
        "/flush_cache": admin.FlushCache(state),
    }
    for path, resource in routes.items():
        app.add_route(path, resource)
    return app
