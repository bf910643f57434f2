#!/usr/bin/env bash
# SGLang's own tools against `trnrt serve` (see docs/SGLANG_TOOLS.md).
#
# Usage: scripts/sglang_compat.sh [SGLANG_VENV]      (default: ../sglang-venv, from the current directory)
#
# SGLANG_VENV is a virtualenv outside this repository that holds sglang==0.5.23 (installed with
# --no-deps over a CPU torch) and sglang-router==0.3.2; docs/SGLANG_TOOLS.md ("Recipes") says how
# to build it. trnrt itself runs from the repository's .venv (override with TRNRT_VENV=DIR).
#
# What it does, printing each command and its result:
#   1. starts two `trnrt serve` workers on free loopback ports with the embedded tiny model and
#      waits for GET /health;
#   2. probes, on worker A, every route and field that bench_serving and sglang-router read
#      (/v1/models, /server_info, /model_info and their /get_* aliases, /get_load, /v1/loads,
#      /health_generate, /flush_cache, /abort_request, /metrics);
#   3. runs `python -m sglang.bench_serving` against worker A with --backend sglang-oai and with
#      --backend sglang (--dataset-name random-ids, the tiny checkpoint as --tokenizer,
#      HF_HUB_OFFLINE=1: nothing is downloaded) and checks that every request completed;
#   4. starts sglang-router (round_robin) in front of both workers, checks that it registered
#      both under the served model name, sends /generate, /v1/completions and
#      /v1/chat/completions (plain and streamed) through it, checks that both workers got traffic,
#      checks the router's fan-out routes (/get_loads, /flush_cache, /engine_metrics), and runs
#      bench_serving --backend sglang once more through the router.
# Every child process is stopped on exit. Exit status: 0 if every check passed, 1 otherwise
# (the summary at the end lists each check). Logs stay in the printed work directory.
#
# Environment: TRNRT_VENV (default: <repo>/.venv), NUM_PROMPTS (32), MAX_CONCURRENCY (8),
# INPUT_LEN (64), OUTPUT_LEN (32), KEEP_WORKDIR=1 keeps the work directory even on success.
set -euo pipefail

SGLANG_VENV=${1:-../sglang-venv}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRNRT_VENV=${TRNRT_VENV:-$REPO/.venv}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-8}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}

SPY=$SGLANG_VENV/bin/python   # the sglang venv's python (bench_serving, sglang-router)
TPY=$TRNRT_VENV/bin/python    # trnrt's python (also used for the JSON checks)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 NO_PROXY='*' no_proxy='*'

for exe in "$SPY" "$TPY" "$TRNRT_VENV/bin/trnrt"; do
    [[ -x $exe ]] || { echo "missing: $exe (see docs/SGLANG_TOOLS.md, Recipes)" >&2; exit 2; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/trnrt-sglang-compat.XXXXXX")
RESULTS=()
FAILED=0

. "$(dirname "${BASH_SOURCE[0]}")/children.sh"  # PIDS, stop_children, cleanup on exit

say() { printf '\n==> %s\n' "$*"; }
show() { printf '+'; printf ' %q' "$@"; printf '\n'; }
record() {  # record PASS|FAIL NAME DETAIL
    RESULTS+=("$(printf '%-4s %-44s %s' "$1" "$2" "$3")")
    [[ $1 == PASS ]] || FAILED=1
    printf '%s: %s %s\n' "$1" "$2" "$3"
}
free_port() { "$TPY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# http METHOD URL [BODY]: prints the status code; the body goes to $WORK/last.body.
http() {
    local args=(-sS -o "$WORK/last.body" -w '%{http_code}' -X "$1" --max-time 120)
    [[ $# -ge 3 ]] && args+=(-H 'Content-Type: application/json' -d "$3")
    curl "${args[@]}" "$2" 2>"$WORK/last.err" || true
}
# jcheck NAME PYEXPR: evaluates PYEXPR with `j` = the JSON of $WORK/last.body and `t` = its text;
# prints the expression's value (a string) and fails if it is falsy or raises.
jcheck() {
    "$TPY" - "$WORK/last.body" "$1" <<'EOF'
import json, sys
t = open(sys.argv[1], encoding="utf-8", errors="replace").read()
try:
    j = json.loads(t)
except ValueError:
    j = None
try:
    v = eval(sys.argv[2], {"j": j, "t": t, "json": json})
except Exception as e:  # noqa: BLE001
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
print(v if isinstance(v, str) else repr(v)[:300])
sys.exit(0 if v else 1)
EOF
}
body_head() { head -c "${1:-300}" "$WORK/last.body" | tr '\n' ' '; }

# probe NAME METHOD URL BODY PYEXPR: one request, status 200 and PYEXPR true.
probe() {
    local name=$1 method=$2 url=$3 body=$4 expr=$5 code out
    if [[ -n $body ]]; then show curl -X "$method" "$url" -d "$body"; code=$(http "$method" "$url" "$body")
    else show curl -X "$method" "$url"; code=$(http "$method" "$url"); fi
    if [[ $code != 200 ]]; then
        record FAIL "$name" "HTTP $code: $(body_head 200)"
        return 0
    fi
    if out=$(jcheck "$expr"); then record PASS "$name" "$out"
    else record FAIL "$name" "HTTP 200 but $expr -> $out; body: $(body_head 200)"; fi
}

start_worker() {  # start_worker NAME PORT
    local log=$WORK/worker-$1.log
    show "$TRNRT_VENV/bin/trnrt" serve --port "$2" --drain-timeout 2
    "$TRNRT_VENV/bin/trnrt" serve --port "$2" --drain-timeout 2 >"$log" 2>&1 &
    PIDS+=($!)
}
wait_health() {  # wait_health NAME URL PID SECONDS
    local t0=$SECONDS
    while ((SECONDS - t0 < $4)); do
        if [[ $(curl -s -o /dev/null -w '%{http_code}' "$2/health" || true) == 200 ]]; then
            record PASS "worker $1 GET /health" "200 after $((SECONDS - t0)) s ($2)"
            return 0
        fi
        kill -0 "$3" 2>/dev/null || break
        sleep 1
    done
    record FAIL "worker $1 GET /health" "no 200 within $4 s; log tail: $(tail -c 400 "$WORK/worker-$1.log" | tr '\n' ' ')"
    return 1
}

echo "trnrt $(cd "$REPO" && git log -1 --format='%h %s' 2>/dev/null | cut -c1-70)"
echo "sglang $("$SPY" -c 'from importlib.metadata import version as v; print(v("sglang"), "/ sglang-router", v("sglang-router"))')"
echo "work directory: $WORK"

say "tiny checkpoint (the --tokenizer for bench_serving)"
show "$TPY" -c "from trnrt.models.tiny import default_model_dir; print(default_model_dir())"
CKPT=$("$TPY" -c "from trnrt.models.tiny import default_model_dir; print(default_model_dir())")
echo "$CKPT"

say "two trnrt workers"
PORT_A=$(free_port); PORT_B=$(free_port)
while [[ $PORT_B == "$PORT_A" ]]; do PORT_B=$(free_port); done
A=http://127.0.0.1:$PORT_A; B=http://127.0.0.1:$PORT_B
start_worker A "$PORT_A"; PID_A=${PIDS[-1]}
start_worker B "$PORT_B"; PID_B=${PIDS[-1]}
wait_health A "$A" "$PID_A" 300 || exit 1
wait_health B "$B" "$PID_B" 300 || exit 1
code=$(http GET "$A/v1/models")
MODEL=$(jcheck 'j["data"][0]["id"]') || { echo "GET /v1/models: $code $(body_head)"; exit 1; }
echo "served model: $MODEL"

say "routes and fields the SGLang tools read, on worker A"
probe "GET /v1/models (bench: data[0].id)" GET "$A/v1/models" "" \
    'j["data"][0]["id"]'
probe "GET /server_info (router: model_path, served_model_name, dp_size; bench: internal_states)" GET "$A/server_info" "" \
    '"model_path=%s served_model_name=%s dp_size=%s internal_states=%s" % (j["model_path"], j["served_model_name"], j.get("dp_size"), type(j.get("internal_states")).__name__) if j["model_path"] and j["served_model_name"] else ""'
probe "GET /get_server_info (router fallback)" GET "$A/get_server_info" "" \
    'j["served_model_name"]'
probe "GET /model_info (router: model_type, architectures; bench: tokenizer_path)" GET "$A/model_info" "" \
    '"tokenizer_path=%s model_type=%s architectures=%s is_generation=%s" % (j.get("tokenizer_path"), j.get("model_type"), j.get("architectures"), j.get("is_generation")) if (j.get("tokenizer_path") or j.get("model_path")) else ""'
probe "GET /get_model_info (router fallback)" GET "$A/get_model_info" "" \
    'j.get("tokenizer_path") or j.get("model_path")'
probe "GET /get_load (router: [ {num_tokens: int} ])" GET "$A/get_load" "" \
    'repr(j) if isinstance(j, list) and j and all(isinstance(e.get("num_tokens"), int) for e in j) else ""'
probe "GET /v1/loads (SGLang 0.5.23 shape)" GET "$A/v1/loads" "" \
    'repr(j["loads"][0])[:200] if isinstance(j.get("loads"), list) and j["loads"] else ""'
probe "GET /health_generate" GET "$A/health_generate" "" 'True'
probe "POST /flush_cache (router fan-out, bench --flush-cache)" POST "$A/flush_cache?timeout=60" "" 'True'
probe "POST /abort_request (unknown rid)" POST "$A/abort_request" '{"rid": "no-such-request"}' 'True'
probe "GET /metrics (router /engine_metrics fan-out)" GET "$A/metrics" "" \
    '"# TYPE" in t and "text"'

bench() {  # bench BACKEND URL LABEL
    local slug=${3// /-}
    local out=$WORK/bench-$1-$slug.jsonl log=$WORK/bench-$1-$slug.log
    local cmd=("$SPY" -m sglang.bench_serving --backend "$1" --base-url "$2"
        --dataset-name random-ids --tokenizer "$CKPT"
        --num-prompts "$NUM_PROMPTS" --max-concurrency "$MAX_CONCURRENCY"
        --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN"
        --seed 1 --output-file "$out")
    say "bench_serving --backend $1 against $3"
    show env HF_HUB_OFFLINE=1 "${cmd[@]}"
    local rc=0
    "${cmd[@]}" >"$log" 2>&1 || rc=$?
    # the warnings sglang prints at import (CUDA-only quantisation kernels) and its two dumps of
    # the parsed arguments are noise here (they stay in the log file)
    grep -v -E 'UserWarning: Only|warnings.warn|FutureWarning: `sglang.bench_serving`|^  from sglang|^(benchmark_args=)?Namespace\(' "$log" \
        | tr '\r' '\n' | grep -v -E '^ *[0-9]+%\|' || true
    local completed
    completed=$("$TPY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["completed"])' "$out" 2>/dev/null || echo 0)
    if [[ $rc == 0 && $completed == "$NUM_PROMPTS" ]]; then
        record PASS "bench_serving --backend $1 ($3)" "rc 0, $completed/$NUM_PROMPTS completed"
    else
        record FAIL "bench_serving --backend $1 ($3)" "rc $rc, $completed/$NUM_PROMPTS completed; $(grep -m3 -i -E 'error|exception|traceback' "$log" | tr '\n' ' ' | cut -c1-300)"
    fi
}
bench sglang-oai "$A" "worker A"
bench sglang "$A" "worker A"

say "sglang-router in front of both workers"
RPORT=$(free_port); PPORT=$(free_port)
R=http://127.0.0.1:$RPORT
RCMD=("$SPY" -m sglang_router.launch_router --host 127.0.0.1 --port "$RPORT"
    --worker-urls "$A" "$B" --policy round_robin
    --prometheus-host 127.0.0.1 --prometheus-port "$PPORT"
    --health-check-interval-secs 5 --worker-startup-timeout-secs 60 --worker-startup-check-interval 1
    --log-level warn)
show env HF_HUB_OFFLINE=1 "${RCMD[@]}"
"${RCMD[@]}" >"$WORK/router.log" 2>&1 &
PIDS+=($!); PID_R=${PIDS[-1]}

# registration: both workers healthy, under the served model name
t0=$SECONDS; registered=""
while ((SECONDS - t0 < 60)); do
    kill -0 "$PID_R" 2>/dev/null || break
    if [[ $(http GET "$R/workers") == 200 ]] && registered=$(jcheck \
        'sorted((w["url"], w["model_id"], w["is_healthy"]) for w in j["workers"]) if len(j["workers"]) == 2 and all(w["is_healthy"] for w in j["workers"]) else ""'); then
        break
    fi
    registered=""; sleep 1
done
show curl "$R/workers"
if [[ -z $registered ]]; then
    record FAIL "router registers both workers" "not within 60 s; router log: $(tail -c 600 "$WORK/router.log" | tr '\n' ' ')"
    exit 1
fi
if [[ $registered == *"'$MODEL'"*"'$MODEL'"* ]]; then
    record PASS "router registers both workers" "$registered"
else
    record FAIL "router registers both workers" "healthy, but not as model '$MODEL' (its id comes from served_model_name/model_path of /server_info): $registered"
fi
if grep -q 'Failed to load tokenizer' "$WORK/router.log"; then
    echo "note: the router could not load the tokenizer from the workers' model_path: $(grep -m1 'Failed to load tokenizer' "$WORK/router.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300)"
fi

count_requests() {  # count_requests URL: requests the worker has seen (from /v1/stats)
    curl -s "$1/v1/stats" | "$TPY" -c 'import json,sys; c=json.load(sys.stdin)["counters"]; print(c.get("requests_arrived", c.get("requests_arrived_total", 0)))' 2>/dev/null || echo "?"
}
before_a=$(count_requests "$A"); before_b=$(count_requests "$B")

probe "router POST /generate" POST "$R/generate" \
    '{"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}' \
    '"text=%r completion_tokens=%s finish_reason=%s" % (j["text"], j["meta_info"]["completion_tokens"], j["meta_info"]["finish_reason"])'
probe "router POST /generate (input_ids, stream)" POST "$R/generate" \
    '{"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}, "stream": true}' \
    '(lambda ev: "%d events, cumulative text, last completion_tokens=%s" % (len(ev), json.loads(ev[-2])["meta_info"]["completion_tokens"]) if ev[-1] == "[DONE]" else "")([l[6:] for l in t.splitlines() if l.startswith("data: ")])'
probe "router POST /v1/completions" POST "$R/v1/completions" \
    "{\"model\": \"$MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 8, \"temperature\": 0}" \
    '"text=%r completion_tokens=%s" % (j["choices"][0]["text"], j["usage"]["completion_tokens"])'
probe "router POST /v1/chat/completions" POST "$R/v1/chat/completions" \
    "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 8, \"temperature\": 0}" \
    '"finish_reason=%s message fields=%s" % (j["choices"][0]["finish_reason"], sorted(k for k, v in j["choices"][0]["message"].items() if v is not None))'
probe "router POST /v1/chat/completions (stream)" POST "$R/v1/chat/completions" \
    "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 8, \"stream\": true}" \
    '(lambda ev: "%d events, ends with [DONE]" % len(ev) if ev and ev[-1] == "[DONE]" else "")([l[6:] for l in t.splitlines() if l.startswith("data: ")])'
probe "router GET /v1/models" GET "$R/v1/models" "" '[m["id"] for m in j["data"]]'

after_a=$(count_requests "$A"); after_b=$(count_requests "$B")
if [[ $before_a != "?" && $after_a != "?" && $after_a -gt $before_a && $after_b -gt $before_b ]]; then
    record PASS "router spreads requests over both workers" "A +$((after_a - before_a)), B +$((after_b - before_b)) requests (/v1/stats)"
else
    record FAIL "router spreads requests over both workers" "A $before_a -> $after_a, B $before_b -> $after_b (/v1/stats)"
fi

probe "router GET /get_loads (fans out /get_load)" GET "$R/get_loads" "" \
    'repr(j["workers"]) if len(j["workers"]) == 2 and all(w["load"] >= 0 for w in j["workers"]) else ""'
probe "router POST /flush_cache (fans out /flush_cache)" POST "$R/flush_cache" "" \
    'j["message"] if j.get("workers_flushed") == 2 else ""'
probe "router GET /engine_metrics (fans out /metrics)" GET "$R/engine_metrics" "" \
    "'series for both workers' if 'worker_addr=\"$A\"' in t and 'worker_addr=\"$B\"' in t else ''"

bench sglang "$R" router

say "what the router logged (warnings and errors, each once)"
sed -E 's/\x1b\[[0-9;]*m//g; s/^[0-9-]+ [0-9:]+ +//; s#[^ ]*/src/#src/#' "$WORK/router.log" \
    | grep -E '^(WARN|ERROR)' | sed -E 's/(request_id|latency)=[^ }]*//g' | sort | uniq -c | cut -c1-400 || echo "(none)"

say "summary"
printf '%s\n' "${RESULTS[@]}"
if ((FAILED)); then echo "FAILED: see above (logs: $WORK)"; exit 1; fi
echo "all checks passed"
