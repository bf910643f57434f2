"""`trnrt bench serve`: a serving benchmark client (the metrics of SGLang's `bench_serving`).

Pure Python: the standard library (http.client, threads), plus rich and typer in the command
line glue. Nothing here imports torch, transformers or the engine, so the client can run against
any OpenAI- or SGLang-compatible server from a machine without them.

- `datasets`: prompt generators, deterministic by seed, made locally (nothing is downloaded);
- `client`: one streamed request per endpoint -> a `RequestResult` (TTFT, ITLs, latency, tokens);
- `runner`: the arrival / concurrency loop (Poisson arrivals, at most `max_concurrency` in flight);
- `metrics`: percentiles and the summary dict (SGLang's result keys);
- `launch`: start and stop `trnrt serve` when no --url is given;
- `cli`: the `trnrt bench serve` command.
"""

from __future__ import annotations
