#!/usr/bin/env bash
# What the page, `settlementd status` and /metrics say at each moment an operator looks, on a big
# library (issue 48, "Done when"): three `serve` replicas of one shard on the database of
# SETTLEMENTD__DATABASE__URL, through a run of late returns, a kill -9 of the replica running it,
# a SIGSTOP of the next one past its lease, the database read-only and back, and a restart of the
# fleet. At each moment it keeps, in OUT (default docs/status/walkthrough):
#   <moment>.png         the page drawn by headless Chromium at 1280 px,
#   <moment>.status.txt  `settlementd status` of the month,
#   <moment>.metrics.txt the settlementd_ gauges of one live replica's /metrics,
# and prints one line per moment. Read them side by side: what each says is what was true then
# (the moment's name and the line printed say what was).
#
# The database is the one given, settled by this release (benches/status-page.sh says how to make
# a 12 M-loan one); the script adds LATE (default 2000000) loans returned in MONTH (default
# 2026-11, a closed month) with ids after the last, which the replicas' late-return sweep then
# settles: a month's run on a big library, as at month end. Needs curl, python3 and chromium.
#
#   SETTLEMENTD__DATABASE__URL=postgresql://… bash benches/incident-walkthrough.sh target/release/settlementd
set -euo pipefail
: "${SETTLEMENTD__DATABASE__URL:?set SETTLEMENTD__DATABASE__URL to a settled library}"
[ $# -eq 1 ] || { echo "usage: incident-walkthrough.sh BIN" >&2; exit 2; }
BIN=$(realpath "$1")
OUT=${OUT:-docs/status/walkthrough}
LATE=${LATE:-2000000}
MONTH=${MONTH:-2026-11}
PSQL=${PSQL:-psql}
CHROMIUM=${CHROMIUM:-chromium}
MONTH_END=$(date -d "$MONTH-01 +1 month -1 day" +%F)
mkdir -p "$OUT"
DIR=$(mktemp -d /tmp/walkthrough.XXXXXX)
sql() { "$PSQL" "$SETTLEMENTD__DATABASE__URL" -XAtq -v ON_ERROR_STOP=1 -c "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export SETTLEMENTD__SHARD__COUNT=1 SETTLEMENTD__SHARD__INDEX=0 SETTLEMENTD__LEASE__HEARTBEAT_SECS=${HEARTBEAT:-2} \
  SETTLEMENTD__LEASE__TTL_SECS=${TTL:-10} SETTLEMENTD__BATCH__SIZE=${BATCH:-200} \
  SETTLEMENTD__DATABASE__MIGRATE_ON_START=false SETTLEMENTD__LOG__FORMAT=json
declare -A pid port
start() {
  port[$1]=$(free_port)
  SETTLEMENTD__HTTP__LISTEN=127.0.0.1:${port[$1]} "$BIN" serve 2>>"$DIR/replica-$1.log" &
  pid[$1]=$!
  for _ in $(seq 1 300); do
    curl -fs "http://127.0.0.1:${port[$1]}/healthz" >/dev/null 2>&1 && return
    sleep 0.2
  done
  echo "replica $1 did not start" >&2; exit 1
}
cleanup() {
  { sql "ALTER SYSTEM RESET default_transaction_read_only" && sql "SELECT pg_reload_conf()"; } >/dev/null 2>&1 || true
  for r in "${!pid[@]}"; do kill -CONT "${pid[$r]}" 2>/dev/null || true; kill -TERM "${pid[$r]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP:-}" ] && cp -r "$DIR" "$KEEP"; rm -rf "$DIR"
}
trap cleanup EXIT
alive() { kill -0 "${pid[$1]}" 2>/dev/null && ! grep -q '^State:.*T' "/proc/${pid[$1]}/status"; }
# A replica that answers (for the page and /metrics): the first live one.
viewer() { for r in a b c; do alive "$r" && { echo "$r"; return; }; done; }
# The replica whose process holds the month's claim (job_runs.owner is host/pid-nonce).
runner() {
  local owner p
  owner=$(sql "SELECT owner FROM settlementd.job_runs WHERE job_name = 'fine-settlement'
                 AND business_date = (DATE '$MONTH-01' + interval '1 month - 1 day')::date AND status = 'RUNNING'")
  p=${owner#*/}; p=${p%%-*}
  for r in a b c; do [ "${pid[$r]:-}" = "$p" ] && { echo "$r"; return; }; done
}
look() {
  local moment=$1 what=$2 v
  v=$(viewer)
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --user-data-dir="$DIR/profile" --window-size=1280,1400 --screenshot="$OUT/$moment.png" \
    "http://127.0.0.1:${port[$v]}/status" >/dev/null 2>&1 || echo "chromium failed at $moment" >&2
  curl -s "http://127.0.0.1:${port[$v]}/metrics" | grep -E '^settlementd_(ready|not_ready|shards_by_owners|shard_owners|expired_leases|months_not_closed|months_held|held_rows|unsettled_in_closed_months|takeovers_total|paused)' \
    >"$OUT/$moment.metrics.txt" || true
  # Last: `status` counts the month's totals so far (seconds on a big month being run).
  local s; s=$(date +%s%3N)
  "$BIN" status --business-date "$MONTH_END" >"$OUT/$moment.status.txt" 2>&1 || true
  echo "status took $(($(date +%s%3N) - s)) ms" >>"$OUT/$moment.status.txt"
  printf '%-14s %s (page of replica %s)\n' "$moment" "$what" "$v"
}
wait_for() { # seconds, description, condition (a shell command)
  local secs=$1 what=$2; shift 2
  for _ in $(seq 1 $((secs * 5))); do eval "$*" && return 0; sleep 0.2; done
  echo "waited ${secs} s and $what never happened" >&2; return 1
}
progress() {
  sql "SELECT coalesce(max(updated), 0) FROM settlementd.job_runs WHERE job_name = 'fine-settlement'
         AND business_date = (DATE '$MONTH-01' + interval '1 month - 1 day')::date AND status = 'RUNNING'"
}

for r in a b c; do start "$r"; done
# Whatever an earlier run left RUNNING (a correction a benchmark stopped) finished first.
wait_for 1800 "every claim at rest" '[ "$(sql "SELECT count(*) FROM settlementd.job_runs WHERE status = '"'RUNNING'"'")" = 0 ]'
sleep "${SETTLEMENTD__LEASE__HEARTBEAT_SECS}"
look at-rest "three replicas of the shard, every month settled"

sql "INSERT INTO public.loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
     SELECT m.last + g, 1 + (g * 7919) % 500000, 1 + g % 10000, DATE '$MONTH-01' - 40,
            DATE '$MONTH-01' - 10 + (g % 10)::int, DATE '$MONTH-01' + (g % 28)::int
       FROM generate_series(1::bigint, $LATE) g, (SELECT max(id) AS last FROM public.loans) m" >/dev/null
wait_for 120 "a replica ran the late returns" '[ -n "$(runner)" ] && [ "$(progress)" -gt 0 ]'
first=$(runner)
look running "$LATE late returns into $MONTH; replica $first runs them ($(progress) settled)"

kill -KILL "${pid[$first]}"
sleep 1
look killed "replica $first killed (-9) during the run; its lease has not expired yet"
wait_for 120 "the lease expired" '[ "$(sql "SELECT count(*) FROM settlementd.job_runs WHERE status = '"'RUNNING'"' AND heartbeat_at < now() - make_interval(secs => $SETTLEMENTD__LEASE__TTL_SECS)")" -gt 0 ]' || true
look expired "replica $first dead, its lease expired; a peer takes it over within a heartbeat"
wait_for 120 "a peer took the run over" '[ -n "$(runner)" ]'
second=$(runner)
look taken-over "replica $second took the run over ($(progress) settled)"

kill -STOP "${pid[$second]}"
sleep $((SETTLEMENTD__LEASE__TTL_SECS + 2))
look frozen "replica $second stopped (SIGSTOP) past its lease"
wait_for 120 "the last replica took the frozen run over" '[ "$(runner)" != "$second" ] && [ -n "$(runner)" ]' || true
look frozen-taken "the third replica took the frozen run over; replica $second still stopped"
kill -CONT "${pid[$second]}"

sql "ALTER SYSTEM SET default_transaction_read_only = on" && sql "SELECT pg_reload_conf()" >/dev/null
sleep $((SETTLEMENTD__LEASE__HEARTBEAT_SECS * 2 + 1))
look read-only "the database read-only (default_transaction_read_only)"
sql "ALTER SYSTEM RESET default_transaction_read_only" && sql "SELECT pg_reload_conf()" >/dev/null
sleep $((SETTLEMENTD__LEASE__HEARTBEAT_SECS * 2 + 1))
look writable "the database writable again"

for r in "${!pid[@]}"; do kill -TERM "${pid[$r]}" 2>/dev/null || true; done
wait 2>/dev/null || true
start "$first"; start "$second"
look restarted "the fleet restarted (two replicas)"
wait_for 900 "the month closed" '[ -z "$(runner)" ] && [ "$(sql "SELECT count(*) FROM public.loans WHERE returned_on >= DATE '"'$MONTH-01'"' AND returned_on < DATE '"'$MONTH-01'"' + 31 AND fine_settled_at IS NULL")" = 0 ]'
sleep $((SETTLEMENTD__LEASE__HEARTBEAT_SECS + 1))
look closed "every late return settled, the month closed again"
