#!/usr/bin/env bash
# trnrt serve in several configurations, and at two concurrencies, measured by `trnrt bench serve`.
#
# Usage: scripts/bench_serve_configs.sh [CHECKPOINT_DIR]
#   (default: the embedded tiny checkpoint)
#
# For each configuration in CONFIGS (a `|`-separated list of `trnrt serve` flag sets; default:
# "--engine-in-process|" = the old single process against the default, the engine core in its own
# process), starts one `trnrt serve`, sends an uncounted warm-up batch, then runs, alternating,
# ROUNDS times: concurrency C1 with N1 requests and concurrency C2 with N2 requests (defaults 8/32
# and 32/64: the serving-speed issue's two points), streamed chat, INPUT_LEN-word prompts,
# OUTPUT_LEN new tokens, greedy, a new prompt seed every run (so the prefix cache never serves a
# prompt it saw). Servers run one after another, never together. Prints one line per run and, per
# configuration, the mean output tok/s at each concurrency and their ratio.
#
# Environment: TRNRT_VENV (<repo>/.venv), CONFIGS, ROUNDS (2), C1 (8), N1 (32), C2 (32), N2 (64),
# INPUT_LEN (64), OUTPUT_LEN (32), THREADS (1: OMP_NUM_THREADS of the server), KEEP_WORKDIR=1.
# Exit status: 0 if every run completed every request, 1 otherwise.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRNRT_VENV=${TRNRT_VENV:-$REPO/.venv}
TPY=$TRNRT_VENV/bin/python
CONFIGS=${CONFIGS:---engine-in-process|}
ROUNDS=${ROUNDS:-2}
C1=${C1:-8}; N1=${N1:-32}; C2=${C2:-32}; N2=${N2:-64}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}
THREADS=${THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_PROXY='*' no_proxy='*'

CKPT=${1:-$("$TPY" -c 'from trnrt.models.tiny import default_model_dir; print(default_model_dir())')}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/trnrt-bench-configs.XXXXXX")
. "$(dirname "${BASH_SOURCE[0]}")/children.sh"  # PIDS, stop_children, cleanup on exit

echo "trnrt $(cd "$REPO" && git log -1 --format='%h' 2>/dev/null), checkpoint $CKPT"
echo "rounds $ROUNDS: concurrency $C1 x $N1 requests, concurrency $C2 x $N2 requests; $INPUT_LEN-word prompts, $OUTPUT_LEN new tokens, greedy, OMP_NUM_THREADS=$THREADS"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"

FAILED=0
seed=100
IFS='|' read -r -a CONF <<<"$CONFIGS"
[[ $CONFIGS == *'|' ]] && CONF+=("")
for i in "${!CONF[@]}"; do
    flags=${CONF[$i]}
    port=$("$TPY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2086  # flags: word-split on purpose
    OMP_NUM_THREADS=$THREADS "$TRNRT_VENV/bin/trnrt" serve --model "$CKPT" --port "$port" --drain-timeout 2 $flags \
        >"$WORK/serve-$i.log" 2>&1 &
    pid=$!; PIDS+=("$pid")
    url=http://127.0.0.1:$port
    for _ in $(seq 600); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' "$url/health" || true) == 200 ]] && break
        kill -0 "$pid" 2>/dev/null || { echo "server [$flags] exited:"; tail -20 "$WORK/serve-$i.log"; exit 1; }
        sleep 1
    done
    echo "config $i: trnrt serve ${flags:-(defaults)}: $(grep -o 'running the compiled graphs[^(]*\|no compiled graphs[^:]*\|engine core running in process' "$WORK/serve-$i.log" | head -2 | tr '\n' ';')"
    common=(--url "$url" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --random-range-ratio 1
            --temperature 0 --endpoint /v1/chat/completions --json --disable-progress)
    "$TRNRT_VENV/bin/trnrt" bench serve "${common[@]}" --num-prompts "$C2" --max-concurrency "$C2" --seed 1000 >/dev/null 2>&1 || true
    for r in $(seq "$ROUNDS"); do
        for point in "$C1:$N1" "$C2:$N2"; do
            c=${point%%:*}; n=${point##*:}; seed=$((seed + 1))
            out=$WORK/c$i-r$r-$c.json
            "$TRNRT_VENV/bin/trnrt" bench serve "${common[@]}" --num-prompts "$n" --max-concurrency "$c" --seed "$seed" \
                >"$out" 2>"$out.err" || FAILED=1
            "$TPY" - "$out" "$n" "$i" "$r" "$c" <<'EOF' || FAILED=1
import json, sys
try:
    s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
except (OSError, ValueError, IndexError):
    print("  no result"); sys.exit(1)
n = int(sys.argv[2])
print(f"  config {sys.argv[3]} round {sys.argv[4]} conc {sys.argv[5]:>3}: {s['completed']}/{n} done, "
      f"{s['output_throughput']:7.1f} tok/s, TTFT p50 {s['median_ttft_ms']:7.1f} ms, ITL p50 {s['median_itl_ms']:6.2f} ms, "
      f"E2E p50 {s['median_e2e_latency_ms']:7.1f} ms")
sys.exit(0 if s["completed"] == n and s["failed"] == 0 else 1)
EOF
        done
    done
    kill -INT "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
done

echo
"$TPY" - "$WORK" "${#CONF[@]}" "$ROUNDS" "$C1" "$C2" <<'EOF'
import json, sys
work, nconf, rounds, c1, c2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
def mean(i, c, key):
    vals = []
    for r in range(1, rounds + 1):
        try:
            vals.append(json.loads(open(f"{work}/c{i}-r{r}-{c}.json").read().splitlines()[-1])[key])
        except (OSError, ValueError, IndexError, KeyError):
            pass
    return sum(vals) / len(vals) if vals else float("nan")
print(f"{'config':<7} {'tok/s conc ' + c1:>14} {'tok/s conc ' + c2:>14} {'ratio':>7} {'TTFT p50 ' + c1:>12} {'TTFT p50 ' + c2:>12}")
for i in range(nconf):
    a, b = mean(i, c1, "output_throughput"), mean(i, c2, "output_throughput")
    print(f"{i:<7} {a:>14.1f} {b:>14.1f} {b / a if a else float('nan'):>6.2f}x "
          f"{mean(i, c1, 'median_ttft_ms'):>10.0f}ms {mean(i, c2, 'median_ttft_ms'):>10.0f}ms")
EOF
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
((FAILED)) && { echo "FAILED: a run did not complete every request (logs: $WORK)"; exit 1; }
exit 0
