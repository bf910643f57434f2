"""`trnrt generate` and `trnrt bench` through typer's CliRunner, on the embedded tiny model."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import greedy
from typer.testing import CliRunner

from trnrt.cli import app


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input, terminal_width=200)


@pytest.fixture
def generate(model_dir):
    """`trnrt generate --model DIR ...` on the same checkpoint as the engine fixtures (the embedded
    default's cache directory changes whenever someone edits the tiny model's code)."""
    def run(*args: str, input: str | None = None):
        return invoke("generate", "--model", str(model_dir), *args, input=input)
    return run


def json_lines(result) -> list[dict]:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


GREEDY = ("--temperature", "0", "--ignore-eos", "--json")


def _engine_threads() -> int:
    import threading

    return sum(t.name == "trnrt-engine" and t.is_alive() for t in threading.enumerate())


@pytest.fixture(autouse=True)
def no_leaked_engine_threads(small_engine):
    before = _engine_threads()
    yield
    assert _engine_threads() == before, "a command left an engine thread running"


# -- generate --------------------------------------------------------------------------------


def test_generate_prompt_json(small_engine, tokenizer, generate):
    [obj] = json_lines(generate("--prompt", "Hello world", "--max-new-tokens", "6", *GREEDY))
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert obj["output_ids"] == greedy(small_engine, ids, 6)
    assert obj["text"] == tokenizer.decode(obj["output_ids"], skip_special_tokens=True)
    assert obj["finish_reason"] == {"type": "length", "matched": None}
    assert "logprobs" not in obj


def test_generate_default_model_and_chat():
    """No --model: the embedded tiny checkpoint; --chat renders the chat template."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    [obj] = json_lines(invoke("generate", "--chat", json.dumps(msgs), "--max-new-tokens", "2", *GREEDY))
    assert len(obj["output_ids"]) == 2 and obj["finish_reason"]["type"] == "length"


def test_generate_prompt_ids_json(small_engine, generate):
    ids = [11, 22, 33, 44, 55]
    [obj] = json_lines(generate("--prompt-ids", json.dumps(ids), "--max-new-tokens", "5", *GREEDY))
    assert obj["output_ids"] == greedy(small_engine, ids, 5)
    two = json_lines(generate("--prompt-ids", json.dumps([ids, [7]]), "--max-new-tokens", "5", *GREEDY))
    assert [o["output_ids"] for o in two] == [obj["output_ids"], greedy(small_engine, [7], 5)]


def test_generate_input_jsonl_keeps_order(tmp_path, small_engine, tokenizer, generate):
    lines = [
        {"prompt": "The quick brown fox", "sampling_params": {"max_new_tokens": 7}},
        {"prompt_ids": [101, 102, 103], "sampling_params": {"max_new_tokens": 2}},
        {"messages": [{"role": "user", "content": "Hi there"}]},  # the command line's --max-new-tokens 4
    ]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    objs = json_lines(generate("--input", str(f), "--max-new-tokens", "4", *GREEDY))
    assert [len(o["output_ids"]) for o in objs] == [7, 2, 4]
    fox = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert objs[0]["output_ids"] == greedy(small_engine, fox, 7)
    assert objs[1]["output_ids"] == greedy(small_engine, [101, 102, 103], 2)
    chat_ids = tokenizer.apply_chat_template(lines[2]["messages"], tokenize=False, add_generation_prompt=True)
    assert objs[2]["output_ids"] == greedy(small_engine, tokenizer.encode(chat_ids, add_special_tokens=False), 4)
    # stdin works too
    assert json_lines(generate("--input", "-", "--max-new-tokens", "4", *GREEDY,
                             input=f.read_text())) == objs


def test_generate_logprobs_shape(generate):
    [obj] = json_lines(generate("--prompt", "Hello", "--max-new-tokens", "3", "--logprobs", "2", *GREEDY))
    lps = obj["logprobs"]
    assert len(lps) == len(obj["output_ids"]) == 3
    for lp, tok in zip(lps, obj["output_ids"]):
        assert set(lp) == {"token_id", "logprob", "top"}
        assert lp["token_id"] == tok and lp["logprob"] <= 0
        assert len(lp["top"]) == 2 and all(len(t) == 2 for t in lp["top"])
        assert lp["top"][0][1] >= lp["top"][1][1]
        assert lp["top"][0][0] == tok and lp["top"][0][1] == pytest.approx(lp["logprob"])  # greedy: the argmax


def test_generate_stop_and_text_output(small_engine, tokenizer, generate):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    full = tokenizer.decode(greedy(small_engine, ids, 8), skip_special_tokens=True)
    stop = full[3:5]
    [obj] = json_lines(generate("--prompt", "Hello world", "--max-new-tokens", "8", "--stop", stop, *GREEDY))
    assert obj["finish_reason"] == {"type": "stop", "matched": stop}
    assert obj["text"] == full[: full.find(stop)]
    r = generate("--prompt", "Hello world", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert "finish: length" in r.stdout and full.split()[0] in r.stdout


def test_generate_engine_failure_exits_1(monkeypatch, generate):
    from trnrt.engine.runner.model_runner import ModelRunner

    def broken(self, rows):
        raise RuntimeError("device lost")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    r = generate("--prompt", "Hello", "--max-new-tokens", "3", "--json")
    assert r.exit_code == 1, r.output
    [obj] = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert obj["finish_reason"]["type"] == "abort" and "device lost" in obj["error"]


@pytest.mark.parametrize("args, where", [
    (["--prompt-ids", "[1, 2"], "--prompt-ids"),
    (["--prompt-ids", "[1, 99999]"], "99999"),
    (["--prompt-ids", "[1, -3]"], "--prompt-ids"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "x", "--logprobs", "99"], "--logprobs"),
    (["--chat", "{\"role\": \"user\"}"], "--chat"),
    (["--input", "MISSING.jsonl"], "--input"),
    (["--input", "BAD"], "line 2"),
    (["--prompt", "x", "--prompt-ids", "[1]"], "exactly one"),
    ([], "exactly one"),
])
def test_generate_bad_input_exits_2(tmp_path, args, where, generate):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "sampling_params": {"temperature": "hot"}}\n')
    args = [str(tmp_path / a) if a == "MISSING.jsonl" else str(bad) if a == "BAD" else a for a in args]
    r = generate(*args)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit)  # a message, not a traceback
    assert "error:" in r.stderr and where in r.stderr, r.stderr
    assert "Traceback" not in r.output


def test_generate_preset_mtp_always_is_greedy_exact(generate):
    """--preset (serve's option): mtp-always speculates (draft + verify) and its greedy tokens are
    the default preset's; stderr says which preset and graphs ran."""
    ids = json.dumps([[11, 22, 33, 44, 55], [7, 8]])
    plain = generate("--preset", "default", "--prompt-ids", ids, "--max-new-tokens", "9", *GREEDY)
    spec = generate("--preset", "mtp-always", "--prompt-ids", ids, "--max-new-tokens", "9", *GREEDY)
    assert [o["output_ids"] for o in json_lines(spec)] == [o["output_ids"] for o in json_lines(plain)]
    assert "graphs: preset default, eager;" in plain.stderr, plain.stderr
    assert "graphs: preset mtp-always, eager, speculative NEXTN k=3;" in spec.stderr, spec.stderr


def test_generate_compiled_runs_the_loaded_graphs(monkeypatch, tmp_path, small_engine, generate):
    """--compiled DIR hands (model, state, config) to trnrt.compile.load_compiled, as `trnrt serve
    --compiled` does, and the engine runs the graphs it returns; stderr lists them as compiled.
    (Here load_compiled is replaced by the graphs' eager callables; tests/compile/
    test_generate_compiled.py runs real artifacts.)"""
    import trnrt.compile
    from trnrt.compile import expand
    from trnrt.compile.export import eager_callable

    loaded: list = []

    def fake_load(directory, model, state, cfg, backend=None):
        loaded.append((directory, backend, cfg.preset))
        return {spec: eager_callable(model, state, cfg, spec) for spec in expand(cfg)}

    monkeypatch.setattr(trnrt.compile, "load_compiled", fake_load)
    ids = [11, 22, 33, 44, 55]
    r = generate("--compiled", str(tmp_path), "--backend", "cpu", "--prompt-ids", json.dumps(ids),
                 "--max-new-tokens", "5", *GREEDY)
    [obj] = json_lines(r)
    assert loaded == [(str(tmp_path), "cpu", "default")]
    assert obj["output_ids"] == greedy(small_engine, ids, 5)
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"graphs: preset default, {len(expand_default())} compiled (cpu, from {tmp_path}); ran: ")
    assert "(compiled)" in line and "(eager)" not in line and "prefill-" in line and "decode-" in line


def expand_default():
    from trnrt.compile import expand
    from trnrt.config.presets import load_preset

    return expand(load_preset("default"))


@pytest.mark.parametrize("args, where", [
    (["--preset", "no-such-preset"], "--preset"),
    (["--compiled", "MISSING"], "--compiled"),
])
def test_generate_bad_preset_or_compiled_exits_2(tmp_path, args, where, generate):
    args = [str(tmp_path / "none") if a == "MISSING" else a for a in args]
    r = generate("--prompt-ids", "[1, 2]", "--max-new-tokens", "2", *args)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert "error:" in r.stderr and where in r.stderr, r.stderr
    assert "Traceback" not in r.output


# -- bench -----------------------------------------------------------------------------------

TINY_BENCH = ("bench", "--batch", "2", "--input-len", "8", "--output-len", "4", "--num-prompts", "2", "--json")
KEYS = {"batch", "input_len", "output_len", "prefill_tok_s", "decode_tok_s", "decode_step_ms", "threads"}


def test_bench_json():
    [obj] = json_lines(invoke(*TINY_BENCH))
    assert set(obj) == KEYS
    assert (obj["batch"], obj["input_len"], obj["output_len"]) == (2, 8, 4)
    assert obj["prefill_tok_s"] > 0 and obj["decode_tok_s"] > 0 and obj["decode_step_ms"] > 0
    # decode_tok_s counts `batch` tokens per step
    assert obj["decode_tok_s"] == pytest.approx(2 * 1000 / obj["decode_step_ms"], rel=0.05)


def test_bench_compare_hf_json():
    [obj] = json_lines(invoke(*TINY_BENCH, "--compare-hf"))
    assert set(obj) == KEYS | {"hf", "ratio"}
    assert set(obj["hf"]) == KEYS and set(obj["ratio"]) == {"prefill", "decode"}
    assert obj["hf"]["decode_tok_s"] > 0 and obj["hf"]["prefill_tok_s"] > 0
    assert obj["ratio"]["decode"] == pytest.approx(obj["decode_tok_s"] / obj["hf"]["decode_tok_s"], rel=0.01)


def test_bench_bad_sizes_exit_2():
    r = invoke("bench", "--output-len", "1", "--json")
    assert r.exit_code == 2 and "--output-len" in r.stderr


def test_bench_runs_compiled_graphs_from_the_loader():
    """run_bench hands (model, state, config) to the compiled loader and the engine runs its graphs."""
    from trnrt.compile import expand
    from trnrt.config import EngineConfig
    from trnrt.benchmark.engine_bench import run_bench
    from trnrt.engine.runner.step import StepFunction

    calls: dict[str, int] = {}

    def loader(model, state, cfg):
        step = StepFunction(model, state, cfg.max_top_logprobs)

        def graph(spec):
            def run(*inputs):
                assert inputs[0].shape == (spec.batch, spec.tokens)  # padded to the spec's static shape
                calls[spec.graph_id] = calls.get(spec.graph_id, 0) + 1
                return step(*inputs)
            return run

        return {spec: graph(spec) for spec in expand(cfg)}

    cfg = EngineConfig(max_model_len=64, decode_batch_buckets=(1, 2), prefill_token_buckets=(16,), num_blocks=17,
                       num_slots=3)
    r = run_bench(batch=2, input_len=8, output_len=4, engine_config=cfg, compiled_loader=loader)
    assert set(r) == KEYS
    # the engine's warm-up: every graph twice (padding rows), before the bench times anything;
    # then 2 prompts prefilled 3 times (warm-up, time to first token, decode run); 2 + 3 decode
    # steps, all in the greedy-sampler graph (the bench decodes greedily)
    want = {spec.graph_id: 2 for spec in expand(cfg)}
    want["prefill-b1-t16-base"] += 6
    want["decode-b2-t1-base-greedy"] += 5
    assert calls == want, calls


def test_bench_compiled_missing_dir_exit_2(tmp_path):
    r = invoke("bench", "--compiled", str(tmp_path / "none"), "--json")
    assert r.exit_code == 2 and "--compiled" in r.stderr and "manifest.json" in r.stderr, r.output
