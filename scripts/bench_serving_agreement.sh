#!/usr/bin/env bash
# SGLang's bench_serving and `trnrt bench serve` against the same `trnrt serve`: do they agree?
#
# Usage: scripts/bench_serving_agreement.sh [SGLANG_VENV]      (default: ../sglang-venv)
#
# SGLANG_VENV holds sglang==0.5.23 (docs/SGLANG_TOOLS.md, "Recipes"). Starts one `trnrt serve`
# (embedded tiny model, TRNRT_ARGS appended), writes a local ShareGPT-format file of random-word
# conversations (nothing is downloaded), then alternates, PAIRS times: bench_serving
# `--backend sglang-oai --dataset-name random --dataset-path FILE` and `trnrt bench serve --backend
# sglang-oai --dataset-name random-ids` (both /v1/completions, streamed, fixed lengths in tokens:
# `--random-range-ratio 1`, NUM_PROMPTS requests, MAX_CONCURRENCY in flight, INPUT_LEN prompt
# tokens, OUTPUT_LEN output tokens; bench_serving sends its ids decoded to text, trnrt as ids), and
# prints each pair's output throughput, TTFT and ITL medians and their differences. Uncounted
# warm-up runs of both clients come first. The prefix cache is flushed (POST /flush_cache) before
# every run: bench_serving's random prompts are the first INPUT_LEN tokens of conversations drawn
# from the file, so a later run would otherwise hit the cache on prompts an earlier one sent.
#
# Environment: TRNRT_VENV (<repo>/.venv), TRNRT_ARGS, PAIRS (3), NUM_PROMPTS (32), MAX_CONCURRENCY
# (8), INPUT_LEN (64), OUTPUT_LEN (32), THREADS (1: the server's OMP_NUM_THREADS), KEEP_WORKDIR=1.
# Exit status: 0 if every run completed every request, 1 otherwise, 2 if a prerequisite is missing.
set -euo pipefail

SGLANG_VENV=${1:-../sglang-venv}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRNRT_VENV=${TRNRT_VENV:-$REPO/.venv}
SPY=$SGLANG_VENV/bin/python
TPY=$TRNRT_VENV/bin/python
PAIRS=${PAIRS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-8}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}
THREADS=${THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 NO_PROXY='*' no_proxy='*'
for exe in "$SPY" "$TPY" "$TRNRT_VENV/bin/trnrt"; do
    [[ -x $exe ]] || { echo "missing: $exe (see docs/SGLANG_TOOLS.md, Recipes)" >&2; exit 2; }
done

CKPT=$("$TPY" -c 'from trnrt.models.tiny import default_model_dir; print(default_model_dir())')
WORK=$(mktemp -d "${TMPDIR:-/tmp}/trnrt-bench-agreement.XXXXXX")
. "$(dirname "${BASH_SOURCE[0]}")/children.sh"  # PIDS, stop_children, cleanup on exit

# A ShareGPT-format file (what bench_serving's random dataset samples its text from).
"$TPY" - "$WORK/sharegpt.json" <<'EOF'
import json, random, sys
from trnrt.benchmark.datasets import random_words
rng = random.Random(0)
convs = [{"id": str(i), "conversations": [{"from": "human", "value": random_words(rng, 200)},
                                          {"from": "gpt", "value": random_words(rng, 200)}]} for i in range(4000)]
json.dump(convs, open(sys.argv[1], "w"))
EOF

port=$("$TPY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$port
# shellcheck disable=SC2086
OMP_NUM_THREADS=$THREADS "$TRNRT_VENV/bin/trnrt" serve --port "$port" --drain-timeout 2 ${TRNRT_ARGS:-} >"$WORK/serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 600); do
    [[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/health" || true) == 200 ]] && break
    sleep 1
done
echo "trnrt $(cd "$REPO" && git log -1 --format='%h'), sglang $("$SPY" -c 'import sglang; print(sglang.__version__)' 2>/dev/null)"
echo "server: $(grep -o 'running the compiled graphs[^(]*\|no compiled graphs[^:]*\|engine core running in process' "$WORK/serve.log" | tr '\n' ';')"
echo "$NUM_PROMPTS requests, concurrency $MAX_CONCURRENCY, $INPUT_LEN in / $OUTPUT_LEN out, /v1/completions streamed; load $(cut -d' ' -f1-3 /proc/loadavg)"

flush() { curl -s -X POST "$URL/flush_cache" -o /dev/null || true; }
sg() {  # sg OUT SEED
    flush
    "$SPY" -m sglang.bench_serving --backend sglang-oai --base-url "$URL" --dataset-name random \
        --dataset-path "$WORK/sharegpt.json" --tokenizer "$CKPT" --num-prompts "$NUM_PROMPTS" \
        --max-concurrency "$MAX_CONCURRENCY" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
        --random-range-ratio 1 --seed "$2" --output-file "$1" --disable-tqdm >"$1.log" 2>&1
}
tb() {  # tb OUT SEED
    flush
    "$TRNRT_VENV/bin/trnrt" bench serve --url "$URL" --backend sglang-oai --dataset-name random-ids \
        --num-prompts "$NUM_PROMPTS" --max-concurrency "$MAX_CONCURRENCY" --random-input-len "$INPUT_LEN" \
        --random-output-len "$OUTPUT_LEN" --random-range-ratio 1 --seed "$2" --json --disable-progress >"$1" 2>"$1.log"
}
sg "$WORK/warm-sg.jsonl" 999 || true
tb "$WORK/warm-tb.json" 999 || true
FAILED=0
for p in $(seq "$PAIRS"); do
    sg "$WORK/sg-$p.jsonl" "$p" || { echo "bench_serving failed: $(tail -3 "$WORK/sg-$p.jsonl.log")"; FAILED=1; }
    tb "$WORK/tb-$p.json" "$p" || { echo "trnrt bench serve failed: $(tail -3 "$WORK/tb-$p.json.log")"; FAILED=1; }
done
"$TPY" - "$WORK" "$PAIRS" "$NUM_PROMPTS" <<'EOF' || FAILED=1
import json, sys
work, pairs, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bad = 0
print(f"{'pair':<5} {'bench_serving tok/s':>20} {'trnrt bench tok/s':>18} {'diff':>7}   TTFT p50 ms (sg / trnrt)   ITL p50 ms (sg / trnrt)")
diffs = []
for p in range(1, pairs + 1):
    try:
        s = json.loads(open(f"{work}/sg-{p}.jsonl").read().splitlines()[-1])
        t = json.loads(open(f"{work}/tb-{p}.json").read().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        print(f"{p:<5} (no result)"); bad = 1; continue
    bad |= s["completed"] != n or t["completed"] != n
    d = (t["output_throughput"] - s["output_throughput"]) / s["output_throughput"] * 100
    diffs.append(d)
    print(f"{p:<5} {s['output_throughput']:>20.1f} {t['output_throughput']:>18.1f} {d:>+6.1f}%   "
          f"{s['median_ttft_ms']:>8.1f} / {t['median_ttft_ms']:<8.1f}        {s['median_itl_ms']:>6.2f} / {t['median_itl_ms']:<6.2f}")
if diffs:
    print(f"largest |difference|: {max(abs(d) for d in diffs):.1f}%")
sys.exit(bad)
EOF
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
((FAILED)) && { echo "FAILED (logs: $WORK)"; exit 1; }
exit 0
