#!/usr/bin/env bash
# One step of `make demo` / `make test` on one line: its name, then how it ended and
# how long it took; the step's own output (apt, cargo, image builds) goes to
# results/logs/NAME.log, printed whole when the step fails. CI=true or VERBOSE=1
# shows the output on the console as it comes.
#
#   scripts/step.sh NAME "what it does" -- COMMAND...
set -uo pipefail

name="$1" title="$2"
shift 2
[ "${1:-}" = "--" ] && shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="$ROOT/results/logs"
mkdir -p "$LOGS"
log="$LOGS/$name.log"
start=$(date +%s)

if [ "${CI:-}" = true ] || [ "${VERBOSE:-0}" = 1 ]; then
    printf '[%s] %s\n' "$name" "$title"
    "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
else
    printf '[%s] %s … ' "$name" "$title"
    "$@" > "$log" 2>&1
    rc=$?
fi
secs=$(( $(date +%s) - start ))
if [ "$rc" != 0 ]; then
    if [ "${CI:-}" != true ] && [ "${VERBOSE:-0}" != 1 ]; then
        printf 'FAILED after %d s; its output (%s):\n' "$secs" "$log"
        cat "$log"
    fi
    printf '[%s] FAILED (exit %d); log: %s\n' "$name" "$rc" "$log"
    exit "$rc"
fi
# A step may say what it found in a last line starting "= " (e.g. "= cached").
note="$(grep '^= ' "$log" | tail -1 | cut -c3-)"
if [ "${CI:-}" = true ] || [ "${VERBOSE:-0}" = 1 ]; then
    printf '[%s] ok, %d s%s\n' "$name" "$secs" "${note:+ ($note)}"
else
    printf '%s%d s\n' "${note:+$note, }" "$secs"
fi
