#!/usr/bin/env bash
# Sets up Baton, starts the disaggregated stack (router + 1 prefill + 1 decode worker on a local Ray)
# on the default model, asks it one question over gRPC, prints the answer and stops the stack.
#   scripts/run.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
port=${BATON_PORT:-50051}
log=$(mktemp)
.venv/bin/baton serve --port "$port" >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 180); do
  grep -q "serving baton.v1.Generation" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 1
done
grep "serving" "$log"
.venv/bin/baton generate --server "127.0.0.1:$port" --chat --temperature 0 \
  --prompt "${1:-What is the capital of France? Answer in one word.}"
