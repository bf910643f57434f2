"""`trnrt serve`: the OpenAI-compatible HTTP API over an EngineClient (Falcon on waitress).

create_app(engine_client, tokenizer_factory, settings) in app.py builds the WSGI app; server.py runs
it on waitress with graceful shutdown; scripted.py is an EngineClient for exact-output tests.
Depends on trnrt.engine's client/request/outputs contract only (never torch or trnrt.models).
"""
