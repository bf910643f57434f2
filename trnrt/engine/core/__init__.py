"""The engine loop and its boundary: `Engine` (the one owner of engine state, on its own thread),
the typed inbox messages, the `EngineClient` interface the server and `trnrt.LLM` use, and the
engine process (`core_proc`) with its client over pipes (`mp_client`, `ipc`)."""
