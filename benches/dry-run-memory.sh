#!/usr/bin/env bash
# What one POST /v1/runs/dry-run costs a replica (docs/SERVE.md, "POST /v1/runs/dry-run"): a
# `serve` process of BIN on its own embedded cluster, seeded with three years of loans
# (`settlementd seed --loans 300000 --years 3 --month 2024-12`), asked BODY (default: the one of
# issue 48, every month since 2000 of 1,024 shards); prints the status, the seconds, the bytes of
# the answer and the process's resident memory before and at its peak (VmRSS, then VmHWM after
# `echo 5 > /proc/PID/clear_refs`). Loopback only; the cluster and its files are removed after.
#
#   bash benches/dry-run-memory.sh [BIN]                  # default BIN: target/debug/settlementd
#   BODY='{"from":"2024-01","to":"2024-12","shards":85}' bash benches/dry-run-memory.sh
set -euo pipefail
BIN=${1:-target/debug/settlementd}
BODY=${BODY:-'{"from":"2000-01","to":"2026-10","shards":1024}'}
TOKEN=dry-run-memory-token-0123456789
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
DIR=$(mktemp -d /tmp/dry-run-memory.XXXXXX)
chmod 777 "$DIR" # the embedded server runs as the postgres user when this runs as root
export SETTLEMENTD__DATABASE__EMBEDDED_DIR=$DIR/data SETTLEMENTD__HTTP__ADMIN_TOKEN=$TOKEN \
  SETTLEMENTD__HTTP__LISTEN=127.0.0.1:$PORT
"$BIN" seed --embedded-db --loans 300000 --years 3 --month 2024-12 >/dev/null
"$BIN" serve --embedded-db 2>"$DIR/serve.log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 1 300); do
  curl -fs "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
  sleep 0.2
done
echo 5 >"/proc/$pid/clear_refs"
before=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
answer=$(curl -s -o "$DIR/answer.json" -w '%{http_code} %{time_total} %{size_download}' -X POST \
  -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' -d "$BODY" \
  "http://127.0.0.1:$PORT/v1/runs/dry-run")
peak=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status")
read -r status seconds bytes <<<"$answer"
echo "$BODY: $status in $seconds s, $bytes bytes; resident $before KiB before, peak $peak KiB (+$(((peak - before) / 1024)) MiB)"
if [ "$status" != 200 ]; then
  head -c 400 "$DIR/answer.json"
  echo
fi
