"""`trnrt generate`: offline generation through the engine (torch imported only when run).

Prompts come from exactly one source: `--prompt TEXT` (repeatable), `--prompt-ids JSON` (a list of
ids, or a list of such lists), `--chat JSON` (a list of messages, or a list of conversations,
rendered with the model's chat template) or `--input FILE.jsonl` (`-` for stdin), one object per
line: {"prompt": "..."} | {"prompt_ids": [...]} | {"messages": [...]}, optionally with
"sampling_params": {...} overriding the command-line values for that line. Every prompt is
submitted at once, so they are batched; answers come back in input order.

Exit codes: 0 ok; 1 a request failed inside the engine; 2 bad input (the message names it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from trnrt.cli import app
from trnrt.cli import serve_options as o

# SamplingParams fields a JSONL line may override under "sampling_params".
_LINE_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "ignore_eos", "skip_special_tokens", "logprobs")


class InputError(ValueError):
    """Bad command-line input; the message says where (option or line)."""


@dataclass
class PromptSpec:
    """One prompt before tokenization: exactly one of text / ids / messages."""

    where: str  # for messages: "--prompt", "--input line 3", ...
    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def _loads(raw: str, where: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({e})") from None


def _check_ids(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise InputError(f"{where}: prompt ids must be a non-empty JSON list of integers")
    for t in v:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InputError(f"{where}: prompt ids must be non-negative integers, got {t!r}")
    return v


def _check_messages(v: Any, where: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise InputError(f"{where}: messages must be a non-empty JSON list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"{where}: message {i} must be an object with a string \"role\"")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise InputError(f"{where}: message {i} \"content\" must be a string or a list of parts")
    return v


def parse_prompt_ids(raw: str) -> list[PromptSpec]:
    v = _loads(raw, "--prompt-ids")
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        return [PromptSpec("--prompt-ids", ids=_check_ids(x, f"--prompt-ids[{i}]")) for i, x in enumerate(v)]
    return [PromptSpec("--prompt-ids", ids=_check_ids(v, "--prompt-ids"))]


def parse_chat(raw: str) -> list[PromptSpec]:
    v = _loads(raw, "--chat")
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        return [PromptSpec("--chat", messages=_check_messages(x, f"--chat[{i}]")) for i, x in enumerate(v)]
    return [PromptSpec("--chat", messages=_check_messages(v, "--chat"))]


def parse_jsonl(lines: list[str], name: str) -> list[PromptSpec]:
    specs: list[PromptSpec] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {n}"
        obj = _loads(line, where)
        if not isinstance(obj, dict):
            raise InputError(f"{where}: each line must be a JSON object")
        keys = [k for k in ("prompt", "prompt_ids", "messages") if k in obj]
        if len(keys) != 1:
            raise InputError(f"{where}: needs exactly one of \"prompt\", \"prompt_ids\", \"messages\"")
        unknown = set(obj) - {"prompt", "prompt_ids", "messages", "sampling_params"}
        if unknown:
            raise InputError(f"{where}: unknown key(s) {', '.join(sorted(map(repr, unknown)))}")
        sp = obj.get("sampling_params", {})
        if not isinstance(sp, dict):
            raise InputError(f"{where}: \"sampling_params\" must be an object")
        bad = set(sp) - set(_LINE_PARAMS)
        if bad:
            raise InputError(f"{where}: unknown sampling_params key(s) {', '.join(sorted(map(repr, bad)))}")
        spec = PromptSpec(where, overrides=dict(sp))
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise InputError(f"{where}: \"prompt\" must be a string")
            spec.text = obj["prompt"]
        elif "prompt_ids" in obj:
            spec.ids = _check_ids(obj["prompt_ids"], where)
        else:
            spec.messages = _check_messages(obj["messages"], where)
        specs.append(spec)
    if not specs:
        raise InputError(f"{name}: no prompts (the file is empty)")
    return specs


def read_input(path: str) -> list[PromptSpec]:
    import sys

    if path == "-":
        return parse_jsonl(sys.stdin.read().splitlines(), "--input -")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--input: cannot read {path}: {e}") from None
    return parse_jsonl(text.splitlines(), f"--input {p.name}")


def _where(name: str, overrides: dict[str, Any], where: str) -> str:
    """A line's own value is reported at the line; a command-line value at its option."""
    return where if name in overrides else "--" + name.replace("_", "-")


def build_sampling_params(base: dict[str, Any], overrides: dict[str, Any], where: str, vocab_size: int | None = None):
    """SamplingParams from the command-line values and a line's overrides; InputError names the source."""
    from trnrt.engine.request import InvalidRequestError, SamplingParams

    kw = {**base, **overrides}
    if isinstance(kw.get("stop"), str):
        kw["stop"] = [kw["stop"]]
    if kw.get("top_k") == 0:
        kw["top_k"] = -1
    for name in ("temperature", "top_p", "min_p"):
        v = kw.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            kw[name] = float(v)
        elif v is not None and not isinstance(v, float):
            raise InputError(f"{_where(name, overrides, where)}: {name} must be a number, got {v!r}")
    for name in ("ignore_eos", "skip_special_tokens"):
        if name in kw and not isinstance(kw[name], bool):
            raise InputError(f"{_where(name, overrides, where)}: {name} must be true or false, got {kw[name]!r}")
    for name in ("stop", "stop_token_ids"):
        if not isinstance(kw.get(name, []), list):
            raise InputError(f"{_where(name, overrides, where)}: {name} must be a list")
    try:
        return SamplingParams(**kw).validate(vocab_size=vocab_size)
    except InvalidRequestError as e:
        raise InputError(f"{_where(e.field or '', overrides, where)}: {e}") from None


def _fail(message: str, code: int = 2) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command("generate")
def generate(
    model: o.Model = None,
    preset: o.Preset = "default",
    compiled: o.Compiled = None,
    backend: o.Backend = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", metavar="TEXT", help="Prompt text (repeatable: several prompts are batched).")] = None,
    prompt_ids: Annotated[Optional[str], typer.Option("--prompt-ids", metavar="JSON", help="JSON list of token ids, or a list of such lists.")] = None,
    chat: Annotated[Optional[str], typer.Option("--chat", metavar="JSON", help="JSON list of messages rendered with the chat template (or a list of conversations).")] = None,
    input_file: Annotated[Optional[str], typer.Option("--input", help="JSONL file ('-': stdin), one {\"prompt\"|\"prompt_ids\"|\"messages\": ...} per line.", metavar="FILE.jsonl")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Most tokens to generate per prompt.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling (-1 or 0: off).")] = -1,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Per-request sampling seed (reproducible whatever the batch).")] = None,
    logprobs: Annotated[Optional[int], typer.Option("--logprobs", help="Return each token's logprob and the top-N alternatives (0-20).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the model's EOS tokens.")] = False,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", metavar="TEXT", help="Stop string (repeatable); trimmed from the output.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per prompt, one per line, in input order.")] = False,
) -> None:
    """Generate offline for one or more prompts (batched through the engine).

    --model, --preset, --compiled and --backend are `trnrt serve`'s (the same graphs run); the
    graphs that ran are listed on stderr at the end."""
    sources = [n for n, v in (("--prompt", prompt), ("--prompt-ids", prompt_ids), ("--chat", chat),
                              ("--input", input_file)) if v]
    if len(sources) != 1:
        _fail("give exactly one of --prompt, --prompt-ids, --chat, --input"
              + (f" (got {', '.join(sources)})" if sources else ""))
    base = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                logprobs=logprobs, ignore_eos=ignore_eos, stop=list(stop or []))
    try:
        if prompt:
            specs = [PromptSpec("--prompt", text=t) for t in prompt]
        elif prompt_ids:
            specs = parse_prompt_ids(prompt_ids)
        elif chat:
            specs = parse_chat(chat)
        else:
            specs = read_input(input_file)  # type: ignore[arg-type]
        # Value checks that need no model, before the (slow) load.
        for s in specs:
            build_sampling_params(base, s.overrides, s.where)
    except InputError as e:
        _fail(str(e))

    from trnrt.config.presets import PresetError, read_preset

    try:
        read_preset(preset)  # before the (slow) load
    except PresetError as e:
        _fail(f"--preset: {e}")
    from trnrt.cli.serve_engine import compiled_loader
    from trnrt.engine.core.llm import LLM

    loader = compiled_loader(compiled, backend) if compiled is not None else None
    try:
        llm = LLM(model, preset=preset, compiled_loader=loader, compiled_backend=backend or "cpu")
    except (ValueError, OSError) as e:  # --model, or artifacts that do not fit (CompiledArtifactError)
        _fail(f"{'--compiled' if compiled and type(e).__name__ == 'CompiledArtifactError' else '--model'}: {e}")
    try:
        code = _run(llm, specs, base, json_out)
        typer.echo(graphs_line(llm.engine, compiled), err=True)
    finally:
        llm.shutdown()
    raise typer.Exit(code)


def graphs_line(engine, compiled_dir: str | None) -> str:
    """Which graphs ran: "graphs: preset P, N compiled (BACKEND, from DIR) | eager; ran: ID xN
    (compiled|eager), ..." (the runner counts each request-serving graph call)."""
    runner = engine.runner
    loaded = {spec.graph_id for spec in getattr(runner, "compiled", {}) or {}}
    info = engine.model_info
    how = f"{len(loaded)} compiled ({info.backend}, from {compiled_dir})" if loaded else "eager"
    spec = getattr(engine, "speculative_config", None)
    if spec is not None:
        how += f", speculative {spec.algorithm} k={spec.num_steps}"
    calls = sorted(getattr(runner, "num_graph_calls", {}).items())
    ran = ", ".join(f"{gid} x{n} ({'compiled' if gid in loaded else 'eager'})" for gid, n in calls)
    return f"graphs: preset {info.preset}, {how}; ran: {ran or 'none'}"


def _run(llm, specs: list[PromptSpec], base: dict, json_out: bool) -> int:
    from trnrt.engine.request import GenerateRequest, InvalidRequestError

    engine = llm.engine
    vocab = engine.model_info.vocab_size
    token_lists: list[list[int]] = []
    params = []
    try:
        for s in specs:
            if s.ids is not None:
                ids = s.ids
                bad = [t for t in ids if t >= vocab]
                if bad:
                    raise InputError(f"{s.where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
            elif s.messages is not None:
                try:
                    ids = llm.encode_chat(s.messages)
                except Exception as e:  # a template error (jinja) or a malformed message
                    raise InputError(f"{s.where}: cannot render the chat template: {type(e).__name__}: {e}") from None
            else:
                ids = llm.tokenizer.encode(s.text, add_special_tokens=False)
            sp = build_sampling_params(base, s.overrides, s.where, vocab)
            try:
                engine.scheduler.validate_request(GenerateRequest(prompt_token_ids=list(ids), sampling_params=sp))
            except InvalidRequestError as e:
                raise InputError(f"{s.where}: {e}") from None
            token_lists.append(list(ids))
            params.append(sp)
    except InputError as e:
        _fail(str(e))
    try:
        results = llm.generate(token_lists, params)
    except InvalidRequestError as e:
        _fail(str(e))
    failed = sum(r.error is not None for r in results)
    if json_out:
        for r in results:
            d = r.to_dict()
            if d.get("finish_reason") is not None:
                d["finish_reason"].setdefault("matched", None)  # always present, null unless a stop matched
            typer.echo(json.dumps(d, ensure_ascii=False))
    else:
        _print_rich(llm, specs, token_lists, results)
    return 1 if failed else 0


def _print_rich(llm, specs: list[PromptSpec], token_lists: list[list[int]], results) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = Console()
    for i, (s, ids, r) in enumerate(zip(specs, token_lists, results)):
        body = Text()
        if s.text is not None:
            shown = s.text
        elif s.messages is not None:
            shown = str(s.messages[-1].get("content", "")) + "\n"
        else:
            shown = llm.tokenizer.decode(ids)
        body.append(shown if len(shown) <= 400 else shown[:400] + " ...", style="dim")
        body.append(r.text, style="bold")
        fr = r.finish_reason
        reason = "?" if fr is None else fr.type
        if fr is not None and fr.type == "stop" and fr.matched is not None:
            reason += f" ({fr.matched!r})"
        sub = f"{len(ids)} prompt + {len(r.output_ids)} generated tokens, finish: {reason}"
        if r.error:
            sub += f", error: {r.error}"
        console.print(Panel(body, title=f"[{i}] {s.where}", title_align="left", subtitle=sub, subtitle_align="right",
                            border_style="red" if r.error else "blue"))
