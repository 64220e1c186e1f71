#!/usr/bin/env bash
# `make serve` on this (fresh) clone must answer /health and /generate.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PORT:-30077}"
log=$(mktemp)
make serve PORT="$PORT" >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do  # a cold start compiles the decode graphs first (README: Decode graphs)
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { cat "$log"; echo "make serve: /health never answered"; exit 1; }
out=$(curl -sf "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
  -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}')
echo "$out" | grep -q '"completion_tokens":8' || { echo "unexpected /generate answer: $out"; exit 1; }
echo "make serve smoke test: /health and /generate answered"
