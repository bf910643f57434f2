"""`trnrt bench serve`: the command (registered by trnrt/cli/bench.py under `trnrt bench`).

Module level imports only typer and the standard library (`trnrt --help` imports this module);
rich and the benchmark modules load inside the command.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Optional

import typer


def _fail(message: str, code: int = 2) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def resolve_kind(backend: Optional[str], endpoint: Optional[str]) -> str:
    """The endpoint kind (chat | completions | generate) from --backend and/or --endpoint."""
    from trnrt.benchmark.client import BACKENDS, ENDPOINTS

    kind_b = kind_e = None
    if backend is not None:
        if backend not in BACKENDS:
            _fail(f"--backend: must be one of {', '.join(BACKENDS)}")
        kind_b = BACKENDS[backend]
    if endpoint is not None:
        by_path = {v: k for k, v in ENDPOINTS.items()}
        kind_e = by_path.get("/" + endpoint.strip("/")) or (endpoint if endpoint in ENDPOINTS else None)
        if kind_e is None:
            _fail(f"--endpoint: must be one of {', '.join(ENDPOINTS.values())}")
    if kind_b and kind_e and kind_b != kind_e:
        _fail(f"--backend {backend} sends {ENDPOINTS[kind_b]}, not --endpoint {endpoint}")
    return kind_b or kind_e or "chat"


def bench_serve(
    url: Annotated[Optional[str], typer.Option("--url", "--base-url", help="A running server (http://host:port). Without it, `trnrt serve` is started for the run and stopped at the end.")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="SGLang / vLLM backend name: sglang (/generate), sglang-oai | vllm | openai (/v1/completions), sglang-oai-chat | vllm-chat | openai-chat (/v1/chat/completions).")] = None,
    endpoint: Annotated[Optional[str], typer.Option("--endpoint", help="/v1/chat/completions (default), /v1/completions or /generate; all streamed.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="With --url: the model name sent in requests (default: GET /v1/models data[0].id). Without: the checkpoint `trnrt serve --model` loads (default: the embedded tiny model).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model name sent in requests (overrides --model's).")] = None,
    serve_arg: Annotated[Optional[list[str]], typer.Option("--serve-arg", help="One more argument for the started `trnrt serve` (repeat: --serve-arg=--preset --serve-arg=batch8).")] = None,
    serve_log: Annotated[Optional[str], typer.Option("--serve-log", help="Append the started server's output to FILE.", metavar="FILE")] = None,
    ready_timeout: Annotated[Optional[float], typer.Option("--ready-timeout", help="Seconds to wait for the server (GET /health) (default: 60 with --url, 600 for a started server).", min=0)] = None,
    dataset_name: Annotated[str, typer.Option("--dataset-name", help="random (random words) | random-ids (token ids; /generate and /v1/completions) | shared-prefix | multi-turn. Made locally; nothing is downloaded.")] = "random",
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Prompts (multi-turn: conversations). shared-prefix: --gsp-num-groups x --gsp-prompts-per-group instead.", min=1)] = 100,
    random_input_len: Annotated[int, typer.Option("--random-input-len", help="Prompt length: words (random, multi-turn: per turn) or tokens (random-ids).", min=1)] = 128,
    random_output_len: Annotated[int, typer.Option("--random-output-len", help="New tokens per request (max_tokens / max_new_tokens).", min=1)] = 64,
    random_range_ratio: Annotated[float, typer.Option("--random-range-ratio", help="Lengths are uniform in [max(int(L * ratio), 1), L]; 1.0 = fixed (SGLang's rule and default 0.0).", min=0.0, max=1.0)] = 0.0,
    gsp_num_groups: Annotated[int, typer.Option("--gsp-num-groups", help="shared-prefix: groups (one system prompt each).", min=1)] = 4,
    gsp_prompts_per_group: Annotated[int, typer.Option("--gsp-prompts-per-group", help="shared-prefix: questions per group.", min=1)] = 8,
    gsp_system_prompt_len: Annotated[int, typer.Option("--gsp-system-prompt-len", help="shared-prefix: words of each shared system prompt.", min=1)] = 256,
    gsp_question_len: Annotated[int, typer.Option("--gsp-question-len", help="shared-prefix: words of each question.", min=1)] = 32,
    gsp_output_len: Annotated[Optional[int], typer.Option("--gsp-output-len", help="shared-prefix: new tokens per request (default: --random-output-len).", min=1)] = None,
    multi_turn_turns: Annotated[int, typer.Option("--multi-turn-turns", "--num-turns", help="multi-turn: user turns per conversation (sent one after another; conversations concurrently).", min=1)] = 3,
    max_concurrency: Annotated[Optional[int], typer.Option("--max-concurrency", help="At most this many requests in flight (default: no limit).", min=1)] = None,
    request_rate: Annotated[float, typer.Option("--request-rate", help="Arrivals per second (Poisson); inf = all at once.")] = math.inf,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts, lengths and arrivals.")] = 1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos/--disable-ignore-eos", help="Send ignore_eos, so every request generates exactly its output length.")] = True,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature (0 = greedy).", min=0.0)] = 0.0,
    extra_request_body: Annotated[Optional[str], typer.Option("--extra-request-body", help="JSON object merged into every request body (/generate: a sampling_params key merges into sampling_params).")] = None,
    warmup_requests: Annotated[int, typer.Option("--warmup-requests", help="Requests sent (one at a time, not counted) before the run.", min=0)] = 1,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="OPENAI_API_KEY", show_envvar=True, help="Sent as `Authorization: Bearer KEY`.")] = None,
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="Seconds a request may wait for its next bytes.", min=0.1)] = 600.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (SGLang's result keys) instead of a table.")] = False,
    output_file: Annotated[Optional[str], typer.Option("--output-file", help="Append the JSON result to FILE as one line (JSONL).", metavar="FILE")] = None,
    disable_progress: Annotated[bool, typer.Option("--disable-progress", "--disable-tqdm", help="No progress bar.")] = False,
) -> None:
    """Benchmark a running server (or a `trnrt serve` started for the run) over HTTP, like
    SGLang's bench_serving and `vllm bench serve`: streamed requests, TTFT / TPOT / ITL / E2E
    latency and throughputs. Exit 0 if every request completed, 1 if any failed."""
    from trnrt.benchmark import datasets as ds
    from trnrt.benchmark.client import ENDPOINTS, TOKEN_ID_ENDPOINTS, ServerError, Target, fetch_token_pool, served_model, wait_ready

    kind = resolve_kind(backend, endpoint)
    name = ds.ALIASES.get(dataset_name, dataset_name)
    if name not in ds.DATASETS:
        _fail(f"--dataset-name: must be one of {', '.join(ds.DATASETS)}")
    if name == "random-ids" and kind not in TOKEN_ID_ENDPOINTS:
        _fail(f"--dataset-name random-ids sends token ids, which {ENDPOINTS[kind]} does not take: use "
              "--endpoint /generate or /v1/completions, or --dataset-name random")
    if not (request_rate > 0):
        _fail("--request-rate: must be > 0 (inf: all at once)")
    extra = None
    if extra_request_body:
        try:
            extra = json.loads(extra_request_body)
        except ValueError as e:
            _fail(f"--extra-request-body: not JSON: {e}")
        if not isinstance(extra, dict):
            _fail("--extra-request-body: must be a JSON object")
    if url is not None and serve_arg:
        _fail("--serve-arg: only without --url (it goes to the `trnrt serve` started for the run)")

    try:
        if name == "random":
            convs = ds.gen_random(num_prompts, random_input_len, random_output_len, random_range_ratio, seed)
        elif name == "shared-prefix":
            convs = ds.gen_shared_prefix(gsp_num_groups, gsp_prompts_per_group, gsp_system_prompt_len,
                                         gsp_question_len, gsp_output_len or random_output_len, seed)
        elif name == "multi-turn":
            convs = ds.gen_multi_turn(num_prompts, multi_turn_turns, random_input_len, random_output_len,
                                      random_range_ratio, seed)
        else:
            convs = None  # random-ids: after the server is up (its token pool)
    except ValueError as e:
        _fail(str(e))

    server = None
    try:
        if url is None:
            from trnrt.benchmark.launch import ServeProcess

            _status(f"starting trnrt serve {' '.join(serve_arg or [])}".rstrip(), json_out)
            server = ServeProcess(model, serve_arg or [], log_path=serve_log,
                                  ready_timeout_s=600.0 if ready_timeout is None else ready_timeout)
            base = server.wait_ready()
            req_model = served_model_name
        else:
            base = url
            req_model = served_model_name or model
        try:
            target = Target(base, api_key=api_key, timeout_s=request_timeout)
        except ValueError as e:
            _fail(f"--url: {e}")
        if url is not None:
            wait_ready(target, 60.0 if ready_timeout is None else ready_timeout)
        target.model = req_model or served_model(target)
        if target.model is None and kind != "generate":
            _fail(f"GET {target.url}/v1/models gave no model id: pass --model NAME")
        if convs is None:
            pool = fetch_token_pool(target, " ".join(ds.WORDS))
            convs = ds.gen_random_ids(num_prompts, random_input_len, random_output_len, random_range_ratio, seed,
                                      pool)
        config = {
            "backend": backend or {"chat": "openai-chat", "completions": "openai", "generate": "sglang"}[kind],
            "endpoint": ENDPOINTS[kind], "dataset_name": name, "base_url": target.url, "model": target.model,
            "num_prompts": num_prompts if name != "shared-prefix" else gsp_num_groups * gsp_prompts_per_group,
            "request_rate": "inf" if math.isinf(request_rate) else request_rate, "max_concurrency": max_concurrency,
            "random_input_len": random_input_len, "random_output_len": random_output_len,
            "random_range_ratio": random_range_ratio, "seed": seed, "ignore_eos": ignore_eos,
            "temperature": temperature, "started_server": url is None,
        }
        if name == "shared-prefix":
            config.update({"gsp_num_groups": gsp_num_groups, "gsp_prompts_per_group": gsp_prompts_per_group,
                           "gsp_system_prompt_len": gsp_system_prompt_len, "gsp_question_len": gsp_question_len,
                           "gsp_output_len": gsp_output_len or random_output_len})
        if name == "multi-turn":
            config["multi_turn_turns"] = multi_turn_turns
        summary = _run(target, kind, convs, config, name=name, warmup=warmup_requests,
                       max_concurrency=max_concurrency, request_rate=request_rate, seed=seed, ignore_eos=ignore_eos,
                       temperature=temperature, extra=extra, progress=not disable_progress, json_out=json_out)
    except ServerError as e:
        _fail(str(e), 1)
    finally:
        if server is not None:
            server.stop()

    if output_file:
        with open(output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(summary) + "\n")
    if json_out:
        typer.echo(json.dumps(summary))
    else:
        print_table(summary)
    if summary["failed"] or summary.get("interrupted"):
        raise typer.Exit(1)


def _status(text: str, quiet: bool) -> None:
    import sys

    if not quiet:
        print(text, file=sys.stderr, flush=True)


def _run(target, kind, convs, config, *, name, warmup, max_concurrency, request_rate, seed, ignore_eos, temperature, extra,
         progress, json_out) -> dict:
    import threading

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trnrt.benchmark import datasets as ds
    from trnrt.benchmark.metrics import summarize
    from trnrt.benchmark.runner import run_benchmark, run_one

    first = convs[0].turns[0]
    for _ in range(warmup):
        res = run_one(target, kind, first, [], ignore_eos=ignore_eos, temperature=temperature, extra_body=extra)
        if not res.success:
            _fail(f"warm-up request to {target.url}: {res.error}", 1)
    total = ds.num_requests(convs)
    err = Console(stderr=True)
    lock = threading.Lock()
    counts = {"done": 0, "failed": 0}
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[failed]}"), console=err, transient=json_out,
                   disable=not progress, refresh_per_second=4)
    with bar:
        task = bar.add_task(f"{kind} {name}", total=total, failed="")

        def on_result(res) -> None:
            with lock:
                counts["done"] += 1
                counts["failed"] += not res.success
                bar.update(task, completed=counts["done"],
                           failed=f"[red]{counts['failed']} failed[/red]" if counts["failed"] else "")

        out = run_benchmark(target, kind, convs, max_concurrency=max_concurrency, request_rate=request_rate,
                            seed=seed, ignore_eos=ignore_eos, temperature=temperature, extra_body=extra,
                            on_result=on_result)
    summary = summarize(out.results, out.duration, {**config, "num_requests": total})
    summary["interrupted"] = out.interrupted
    return summary


def _f(v, digits: int = 2) -> str:
    return f"{v:,.{digits}f}" if isinstance(v, (int, float)) else str(v)


def print_table(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Serving benchmark: {s['endpoint']} at {s['base_url']}, {s['dataset_name']}",
              title_justify="left", show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    conc = s["max_concurrency"] if s["max_concurrency"] is not None else "not set"
    rows = [
        ("Backend", s["backend"]), ("Model", s["model"]), ("Traffic request rate", s["request_rate"]),
        ("Max request concurrency", conc),
        ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", _f(s["duration"])),
        ("Total input tokens" + ("" if s["input_tokens_reported"] else " (nominal)"), s["total_input_tokens"]),
        ("Total generated tokens" + ("" if s["output_tokens_reported"] else " (chunks)"), s["total_output_tokens"]),
        ("Request throughput (req/s)", _f(s["request_throughput"])),
        ("Input token throughput (tok/s)", _f(s["input_throughput"])),
        ("Output token throughput (tok/s)", _f(s["output_throughput"])),
        ("Peak output token throughput (tok/s)", _f(s["max_output_tokens_per_s"])),
        ("Peak concurrent requests", s["max_concurrent_requests"]),
        ("Total token throughput (tok/s)", _f(s["total_throughput"])),
        ("Concurrency", _f(s["concurrency"])),
    ]
    for label, v in rows:
        t.add_row(label, str(v))
    for title, key in (("End-to-End Latency", "e2e_latency"), ("Time to First Token", "ttft"),
                       ("Time per Output Token (excl. 1st token)", "tpot"), ("Inter-Token Latency", "itl")):
        t.add_section()
        t.add_row(f"[bold]{title}[/bold]", "")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            t.add_row(f"{label} {_SHORT[key]} (ms)", _f(s[f"{stat}_{key}_ms"]))
        if key == "itl":
            t.add_row(f"Max {_SHORT[key]} (ms)", _f(s["max_itl_ms"]))
    if s.get("errors"):
        t.add_section()
        for e in s["errors"]:
            t.add_row(f"[red]error x{e['count']}[/red]", e["error"][:120])
    Console().print(t)


_SHORT = {"e2e_latency": "E2E Latency", "ttft": "TTFT", "tpot": "TPOT", "itl": "ITL"}
