#!/usr/bin/env bash
# What the status page and `settlementd status` cost on a big library (issue 48, item 2): for each
# BIN in turn, one `serve` replica (shard 0 of SHARDS, default 1: the count the library was settled with) on the database of SETTLEMENTD__DATABASE__URL,
# then REPS requests of GET /status, REPS `settlementd status` commands (one month, the page's own
# read) and REPS times the same indexed SELECT of job_runs through psql (the floor a page that
# answers from small state tables can reach), interleaved so that every figure of a BIN comes from
# the same minutes. Prints each median and its ratio to the SELECT's; with INFLIGHT=1, the figures
# are taken while three corrections of three months run (each re-prices a month under another
# rate, as `settlementd correct` does, and the next one puts it back).
#
# The database is the one given (it is not created or reset): settle a library first, e.g.
#   settlementd migrate && settlementd seed --loans 12000000 --month 2026-10 --years 3 &&
#   settlementd run --from 2023-11 --to 2026-10
# and then
#   SETTLEMENTD__DATABASE__URL=postgresql://… bash benches/status-page.sh target/release/settlementd [OTHER_BIN]
#
# Times are whole requests and whole commands (curl's time_total; a command's wall time, its start
# included, as the SELECT's psql is), on one machine, in one run: compare ratios, not milliseconds
# across machines.
set -euo pipefail
: "${SETTLEMENTD__DATABASE__URL:?set SETTLEMENTD__DATABASE__URL to a settled library}"
REPS=${REPS:-15}
MONTH=${MONTH:-2026-10-31}
PSQL=${PSQL:-psql}
[ $# -ge 1 ] || { echo "usage: status-page.sh BIN [BIN...]" >&2; exit 2; }
DIR=$(mktemp -d /tmp/status-page.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export SETTLEMENTD__HTTP__LISTEN=127.0.0.1:$PORT SETTLEMENTD__SHARD__COUNT=${SHARDS:-1} SETTLEMENTD__SHARD__INDEX=0 \
  SETTLEMENTD__DATABASE__MIGRATE_ON_START=false
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP:-}" ] && cp -r "$DIR" "$KEEP"; rm -rf "$DIR"
}
trap cleanup EXIT

now_ms() { date +%s%3N; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
select_ms() {
  local s; s=$(now_ms)
  "$PSQL" "$SETTLEMENTD__DATABASE__URL" -XAtq -c "SELECT shard, status, attempt FROM settlementd.job_runs
     WHERE job_name = 'fine-settlement' AND business_date = DATE '$MONTH' AND shards = ${SHARDS:-1}" >/dev/null
  echo $(($(now_ms) - s))
}

# Three corrections in flight, each of its own month, over and over until killed.
corrections() {
  local bin=$1 i=0
  for m in 2026-07-31 2026-08-31 2026-09-30; do
    (
      while :; do
        i=$((i + 1))
        rate=$((i % 2 ? 60 : 50))
        SETTLEMENTD__FINE__DAILY_RATE_CENTS=$rate "$bin" correct --business-date "$m" \
          --reason "status-page benchmark" --key "bench-$m-$i-$$" >/dev/null 2>>"$DIR/correct.log" || sleep 1
      done
    ) &
    pids+=($!)
  done
}

for bin in "$@"; do
  "$bin" serve 2>"$DIR/serve.log" &
  serve=$!
  pids+=($serve)
  for _ in $(seq 1 300); do
    curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
    sleep 0.2
  done
  [ "${INFLIGHT:-0}" = 1 ] && { corrections "$bin"; sleep 5; }
  # Views until no closed month is being counted: what a replica counts once (a closed month's
  # facts, kept in month_facts for every process after) is not what a view costs. Printed.
  s=$(now_ms)
  for _ in $(seq 1 600); do
    curl -s -o "$DIR/page.html" "http://127.0.0.1:$PORT/status" || true
    grep -q "being computed" "$DIR/page.html" || break
    sleep 1
  done
  echo "$bin: the page counted what it does not keep in $(($(now_ms) - s)) ms"
  "$bin" status --business-date "$MONTH" >/dev/null 2>&1 || true
  : >"$DIR/page"; : >"$DIR/cli"; : >"$DIR/select"
  for _ in $(seq 1 "$REPS"); do
    code_time=$(curl -s -o "$DIR/page.html" -w '%{http_code} %{time_total}' "http://127.0.0.1:$PORT/status")
    read -r code secs <<<"$code_time"
    [ "$code" = 200 ] || echo "GET /status answered $code" >&2
    python3 -c "print(round($secs * 1000))" >>"$DIR/page"
    s=$(now_ms)
    "$bin" status --business-date "$MONTH" >/dev/null 2>>"$DIR/status.err" || echo "status failed" >&2
    echo $(($(now_ms) - s)) >>"$DIR/cli"
    select_ms >>"$DIR/select"
  done
  page=$(median <"$DIR/page"); cli=$(median <"$DIR/cli"); sel=$(median <"$DIR/select")
  not_closed=$(grep -c "not closed" "$DIR/page.html" || true)
  echo "$bin$([ "${INFLIGHT:-0}" = 1 ] && echo ', three corrections in flight'): GET /status median $page ms ($(python3 -c "print(round($page / $sel, 1))") x the SELECT), status median $cli ms ($(python3 -c "print(round($cli / $sel, 1))") x), SELECT of job_runs median $sel ms; REPS=$REPS; the last page says 'not closed' $not_closed times"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
done
