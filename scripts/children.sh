# Sourced by the benchmark and compatibility scripts: their child processes (PIDS) are stopped on
# exit (TERM, then KILL after 10 s), and the work directory WORK is removed unless the run failed
# or KEEP_WORKDIR=1.
PIDS=()
stop_children() {
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.2
    done
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
on_exit() {
    local rc=$?
    stop_children
    if [[ $rc -eq 0 && ${KEEP_WORKDIR:-0} != 1 ]]; then rm -rf "$WORK"; else echo "logs: $WORK"; fi
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM
