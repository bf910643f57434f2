#!/usr/bin/env bash
# trnrt serve vs transformers serve on the same checkpoint, measured by `trnrt bench serve`.
#
# Usage: scripts/bench_serve_vs_transformers.sh [CHECKPOINT_DIR]
#   (default: the embedded tiny checkpoint, trnrt.models.tiny.default_model_dir())
#
# What it does:
#   1. starts `trnrt serve --model CKPT` and `transformers serve CKPT` (CPU), each on a free port;
#   2. runs `trnrt bench serve` against each (after one uncounted warm-up batch of MAX_CONCURRENCY
#      requests per side), alternating, ROUNDS rounds: streamed
#      /v1/chat/completions, NUM_PROMPTS requests, MAX_CONCURRENCY in flight, INPUT_LEN-word random
#      prompts (the same prompts on both sides: same seed; a new seed every round and for the
#      warm-up, so trnrt's prefix cache never serves a prompt it saw before), OUTPUT_LEN new tokens,
#      greedy;
#   3. prints each run and the ratios trnrt / transformers: output tok/s (higher is better for
#      trnrt above 1), and transformers / trnrt for TTFT p50 and ITL p50 (how many times lower
#      trnrt's are).
#
# Fixed output length on both sides: trnrt gets `ignore_eos` + `max_tokens`; transformers serve
# refuses unknown fields such as `ignore_eos`, so it gets its own `generation_config` field (a JSON
# string): min_new_tokens = max_new_tokens = OUTPUT_LEN, do_sample false.
#
# transformers serve needs transformers' "serving" extra (fastapi, uvicorn, starlette, accelerate),
# which trnrt does not depend on. TF_PYTHON is the interpreter that runs it (default: trnrt's venv
# python; set PYTHONPATH to a directory holding those packages if they live elsewhere). If it cannot
# import them the script says so and exits 2. transformers serve also loads the checkpoint with
# AutoProcessor, which for a glm5_next config asks for an image processor that a text-only
# checkpoint lacks; the script runs it through a small wrapper that falls back to AutoTokenizer
# when AutoProcessor fails (nothing else changes).
#
# Environment: TRNRT_VENV (<repo>/.venv), TF_PYTHON ($TRNRT_VENV/bin/python), NUM_PROMPTS (32),
# MAX_CONCURRENCY (8), INPUT_LEN (64), OUTPUT_LEN (32), ROUNDS (2), TRNRT_ARGS (more `trnrt serve`
# flags, e.g. "--compiled DIR" or "--disable-compiled-cache"), THREADS (1: OMP_NUM_THREADS of
# both servers; with 2 threads on a shared 2-core box transformers' steps collapse, see
# docs/PERFORMANCE.md "Two threads"), KEEP_WORKDIR=1 keeps the logs and JSON results.
# Exit status: 0 if every run completed every request, 1 otherwise, 2 if a prerequisite is missing.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRNRT_VENV=${TRNRT_VENV:-$REPO/.venv}
TPY=$TRNRT_VENV/bin/python
TF_PYTHON=${TF_PYTHON:-$TPY}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-8}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_PROXY='*' no_proxy='*'

for exe in "$TPY" "$TRNRT_VENV/bin/trnrt" "$TF_PYTHON"; do
    [[ -x $exe ]] || { echo "missing: $exe" >&2; exit 2; }
done
if ! why=$("$TF_PYTHON" -c 'import fastapi, uvicorn, starlette, accelerate, transformers.cli.serving' 2>&1); then
    echo "transformers serve cannot run with $TF_PYTHON: $(echo "$why" | tail -1)" >&2
    echo "it needs transformers[serving] (fastapi, uvicorn, starlette, accelerate); install them there, or" >&2
    echo "point TF_PYTHON / PYTHONPATH at an environment that has them" >&2
    exit 2
fi

CKPT=${1:-$("$TPY" -c 'from trnrt.models.tiny import default_model_dir; print(default_model_dir())')}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/trnrt-bench-vs-hf.XXXXXX")
. "$(dirname "${BASH_SOURCE[0]}")/children.sh"  # PIDS, stop_children, cleanup on exit

free_port() { "$TPY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() {  # wait_health NAME URL PID SECONDS LOG
    local t0=$SECONDS
    while ((SECONDS - t0 < $4)); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' "$2/health" || true) == 200 ]] && { echo "$1 ready at $2 after $((SECONDS - t0)) s"; return 0; }
        kill -0 "$3" 2>/dev/null || break
        sleep 1
    done
    echo "$1 did not answer GET /health within $4 s; log tail:" >&2
    tail -n 20 "$5" >&2
    return 1
}

cat >"$WORK/tf_serve.py" <<'EOF'
"""`transformers serve` with one change: a checkpoint without an image processor gets its tokenizer."""
import sys

from transformers.cli.serving import model_manager

_load = model_manager.ModelManager._load_processor


def _load_processor(self, model_id_and_revision, gguf_file=None):
    try:
        return _load(self, model_id_and_revision, gguf_file=gguf_file)
    except OSError:
        from transformers import AutoTokenizer

        model_id, revision = model_id_and_revision.split("@", 1)
        return AutoTokenizer.from_pretrained(model_id, revision=revision)


model_manager.ModelManager._load_processor = _load_processor
from transformers.cli.transformers import main  # noqa: E402

sys.argv = ["transformers", "serve", *sys.argv[1:]]
sys.exit(main())
EOF

echo "trnrt $(cd "$REPO" && git log -1 --format='%h' 2>/dev/null), transformers $("$TPY" -c 'import transformers; print(transformers.__version__)')"
echo "checkpoint: $CKPT"
echo "$NUM_PROMPTS requests, concurrency $MAX_CONCURRENCY, $INPUT_LEN-word prompts, $OUTPUT_LEN new tokens, greedy, $ROUNDS rounds, OMP_NUM_THREADS=$THREADS"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"

TP=$(free_port); HP=$(free_port)
while [[ $HP == "$TP" ]]; do HP=$(free_port); done
T=http://127.0.0.1:$TP; H=http://127.0.0.1:$HP
# shellcheck disable=SC2086  # TRNRT_ARGS: more `trnrt serve` flags, word-split on purpose
OMP_NUM_THREADS=$THREADS "$TRNRT_VENV/bin/trnrt" serve --model "$CKPT" --port "$TP" --drain-timeout 2 ${TRNRT_ARGS:-} >"$WORK/trnrt.log" 2>&1 &
PIDS+=($!); TPID=$!
OMP_NUM_THREADS=$THREADS "$TF_PYTHON" "$WORK/tf_serve.py" --host 127.0.0.1 --port "$HP" --device cpu "$CKPT" >"$WORK/transformers.log" 2>&1 &
PIDS+=($!); HPID=$!
wait_health "trnrt serve" "$T" "$TPID" 600 "$WORK/trnrt.log"
wait_health "transformers serve" "$H" "$HPID" 600 "$WORK/transformers.log"

COMMON=(--num-prompts "$NUM_PROMPTS" --max-concurrency "$MAX_CONCURRENCY" --random-input-len "$INPUT_LEN"
    --random-output-len "$OUTPUT_LEN" --random-range-ratio 1 --temperature 0
    --endpoint /v1/chat/completions --json --disable-progress)
TF_BODY=$("$TPY" -c 'import json, sys; n = int(sys.argv[1]); print(json.dumps({"generation_config": json.dumps({"min_new_tokens": n, "max_new_tokens": n, "do_sample": False})}))' "$OUTPUT_LEN")
FAILED=0
run() {  # run SIDE ROUND
    local out=$WORK/$1-$2.json cmd
    if [[ $1 == trnrt ]]; then cmd=("$TRNRT_VENV/bin/trnrt" bench serve --url "$T" "${COMMON[@]}" --seed "$2")
    else cmd=("$TRNRT_VENV/bin/trnrt" bench serve --url "$H" --model "$CKPT" --disable-ignore-eos
              --extra-request-body "$TF_BODY" "${COMMON[@]}" --seed "$2"); fi
    printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
    "${cmd[@]}" >"$out" 2>"$WORK/$1-$2.err" || { echo "  (exit $?: $(tail -c 300 "$WORK/$1-$2.err"))"; FAILED=1; }
    "$TPY" - "$out" "$NUM_PROMPTS" "$OUTPUT_LEN" <<'EOF' || FAILED=1
import json, sys
try:
    s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
except (OSError, ValueError, IndexError):
    print("  no result"); sys.exit(1)
n, m = int(sys.argv[2]), int(sys.argv[3])
print(f"  completed {s['completed']}/{n}, {s['total_output_tokens']} output tokens, {s['duration']:.1f} s: "
      f"{s['output_throughput']:.1f} tok/s, TTFT p50 {s['median_ttft_ms']:.1f} ms, ITL p50 {s['median_itl_ms']:.2f} ms")
sys.exit(0 if s["completed"] == n and s["failed"] == 0 and s["total_output_tokens"] == n * m else 1)
EOF
}
# Warm-up, not counted: one batch of MAX_CONCURRENCY requests per side, so that neither side's first
# round pays for first-use costs (trnrt's first batch-2..8 decode steps, allocator growth).
for side in trnrt transformers; do
    url=$T; [[ $side == transformers ]] && url=$H
    extra=(); [[ $side == transformers ]] && extra=(--model "$CKPT" --disable-ignore-eos --extra-request-body "$TF_BODY")
    echo "warm-up: $side"
    "$TRNRT_VENV/bin/trnrt" bench serve --url "$url" "${extra[@]}" "${COMMON[@]}" --num-prompts "$MAX_CONCURRENCY" --seed 1000 \
        >"$WORK/warmup-$side.json" 2>&1 || echo "  (warm-up exit $?: $(tail -c 300 "$WORK/warmup-$side.json"))"
done
for r in $(seq "$ROUNDS"); do
    run trnrt "$r"
    run transformers "$r"
done

echo
"$TPY" - "$WORK" "$ROUNDS" <<'EOF'
import json, sys
work, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'round':<6} {'output tok/s (trnrt / hf)':<30} {'TTFT p50 ms (hf / trnrt)':<30} {'ITL p50 ms (hf / trnrt)':<30}")
ratios = []
for r in range(1, rounds + 1):
    try:
        t = json.loads(open(f"{work}/trnrt-{r}.json").read().splitlines()[-1])
        h = json.loads(open(f"{work}/transformers-{r}.json").read().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        print(f"{r:<6} (a run gave no result)")
        continue
    q = (t["output_throughput"] / h["output_throughput"] if h["output_throughput"] else float("nan"),
         h["median_ttft_ms"] / t["median_ttft_ms"] if t["median_ttft_ms"] else float("nan"),
         h["median_itl_ms"] / t["median_itl_ms"] if t["median_itl_ms"] else float("nan"))
    ratios.append(q)
    print(f"{r:<6} {t['output_throughput']:>8.1f} / {h['output_throughput']:<8.1f} = {q[0]:>5.2f}x    "
          f"{h['median_ttft_ms']:>8.1f} / {t['median_ttft_ms']:<8.1f} = {q[1]:>5.2f}x    "
          f"{h['median_itl_ms']:>7.2f} / {t['median_itl_ms']:<7.2f} = {q[2]:>5.2f}x")
if ratios:
    mean = [sum(x[i] for x in ratios) / len(ratios) for i in range(3)]
    print(f"{'mean':<6} {'':>19}{mean[0]:>5.2f}x    {'':>19}{mean[1]:>5.2f}x    {'':>17}{mean[2]:>5.2f}x")
EOF
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
if ((FAILED)); then echo "FAILED: a run did not complete every request (logs: $WORK)"; exit 1; fi
