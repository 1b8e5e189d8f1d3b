#!/usr/bin/env bash
# Validate every deployment file offline. CI runs `bash deploy/validate.sh`;
# `bash deploy/validate.sh STEP...` runs some steps. Any finding fails.
#
# Steps (in order):
#   systemd     systemd-analyze verify on the units; it exits 0 on warnings,
#               so any output at all is a failure
#   render      Helm lint (strict) + render of the chart for every scenario in
#               deploy/checks.py, with Helm's Go SDK (pip: helm-python-sdk)
#   yaml        yamllint -s on deploy/ and on the rendered chart
#   kubernetes  kubernetes-validate --strict on deploy/kubernetes/ and on the
#               rendered chart (no warnings allowed but the ServiceMonitor CRD's)
#   same        deploy/kubernetes/ equals the chart's default render
#   configs     every kvstore TOML (systemd example, ConfigMaps) loads in
#               `kvstore serve|indexer --print-config`
#   dashboard   the Grafana dashboard is well formed and every query parses
#               (promtool check rules)
#   metrics     a live daemon's /metrics passes `promtool check metrics`, and
#               it exports every metric the dashboard queries
#
# Needs: systemd-analyze, promtool (apt: prometheus), yamllint,
# kubernetes-validate, helm-python-sdk (pip), and kvstore installed.
set -euo pipefail

DEPLOY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$DEPLOY")"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-validate.XXXXXX")"
RENDERED="$WORK/rendered"
DAEMON_PID=""

cleanup() {
  if [[ -n "$DAEMON_PID" ]] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }
need() { command -v "$1" >/dev/null 2>&1 || fail "$1 not found ($2)"; }

check_systemd() {
  step "systemd-analyze verify"
  need systemd-analyze "apt-get install systemd"
  # The units name the documented install path /opt/kvstore/bin/kvstore, which
  # verify insists exists; check them against the kvstore actually installed
  # here instead, and nothing else changed.
  local kvstore_bin unit copy out
  kvstore_bin="$(command -v kvstore)" || fail "kvstore is not installed (pip install -e .)"
  mkdir -p "$WORK/units"
  for unit in "$DEPLOY"/systemd/*.service; do
    copy="$WORK/units/$(basename "$unit")"
    grep -q '^ExecStart=/opt/kvstore/bin/kvstore ' "$unit" || fail "$unit: ExecStart is not /opt/kvstore/bin/kvstore"
    sed "s#^ExecStart=/opt/kvstore/bin/kvstore #ExecStart=$kvstore_bin #" "$unit" >"$copy"
    out="$(cd "$WORK/units" && systemd-analyze verify "./$(basename "$unit")" 2>&1)" \
      || fail "$unit: $out"
    [[ -z "$out" ]] || fail "$unit: systemd-analyze verify printed:
$out"
    echo "ok: $unit"
  done
}

check_render() {
  step "helm lint + render"
  "$PYTHON" "$DEPLOY/checks.py" render "$RENDERED"
}

ensure_rendered() {
  [[ -d "$RENDERED" ]] || check_render
}

check_yaml() {
  ensure_rendered
  step "yamllint"
  need yamllint "pip install yamllint"
  local out
  # From deploy/, so the config's ignore pattern (chart templates) applies.
  out="$(cd "$DEPLOY" && yamllint -s -c .yamllint.yaml . 2>&1)" || fail "yamllint deploy/:
$out"
  out="$(yamllint -s -c "$DEPLOY/.yamllint.yaml" "$RENDERED" 2>&1)" || fail "yamllint on the rendered chart:
$out"
  echo "ok: yamllint"
}

check_kubernetes() {
  ensure_rendered
  step "kubernetes-validate --strict"
  need kubernetes-validate "pip install kubernetes-validate"
  local out bad
  out="$(kubernetes-validate --strict "$DEPLOY"/kubernetes/*.yaml "$RENDERED"/*.yaml 2>&1)" \
    || fail "kubernetes-validate:
$out"
  # Its schemas cover Kubernetes' own kinds; for a CRD it can only warn that it
  # has none. Only the ServiceMonitor may get that warning; anything else fails.
  bad="$(grep -v '^INFO ' <<<"$out" \
    | grep -v "Couldn't find schema for kind ServiceMonitor with api version monitoring.coreos.com/v1" || true)"
  [[ -z "$bad" ]] || fail "kubernetes-validate:
$bad"
  grep -c '^INFO .* passed' <<<"$out" | xargs echo "ok: kubernetes-validate, resources passed:"
}

check_same() {
  ensure_rendered
  step "deploy/kubernetes == chart render"
  "$PYTHON" "$DEPLOY/checks.py" same "$RENDERED/default.yaml"
}

check_configs() {
  ensure_rendered
  step "kvstore configs"
  local rendered
  "$PYTHON" "$DEPLOY/checks.py" configs "$DEPLOY"/systemd/*.toml
  "$PYTHON" "$DEPLOY/checks.py" configs "$DEPLOY"/kubernetes/*.yaml
  for rendered in "$RENDERED"/*.yaml; do
    "$PYTHON" "$DEPLOY/checks.py" configs "$rendered"
  done
}

check_dashboard() {
  step "grafana dashboard"
  need promtool "apt-get install prometheus"
  local out
  "$PYTHON" "$DEPLOY/checks.py" dashboard "$DEPLOY/grafana/kvstore-dashboard.json" "$WORK/dashboard-rules.yaml"
  # Prometheus' own PromQL parser on every panel query.
  out="$(promtool check rules "$WORK/dashboard-rules.yaml" 2>&1)" || fail "promtool check rules (dashboard queries):
$out"
  echo "ok: dashboard queries parse"
}

check_metrics() {
  step "promtool check metrics on a live daemon"
  need promtool "apt-get install prometheus"
  local ready="$WORK/daemon.out" metrics="$WORK/metrics.txt" address="" out
  mkdir -p "$WORK/daemon"
  # Ports 0: the daemon picks free ones and prints them in its ready line.
  env -u KVSTORE_CONFIG "$PYTHON" -m kvstore serve \
    --set "server.socket_path=$WORK/daemon/kvstore.sock" \
    --set server.tcp_address=127.0.0.1:0 \
    --set metrics.address=127.0.0.1:0 \
    --set "dram.path=$WORK/daemon/kvstore.dram" \
    --set dram.capacity_bytes=64MiB \
    --set peer.enabled=true --set peer.secret=validate-only --set peer.transport=grpc_stream \
    >"$ready" 2>"$WORK/daemon.err" &
  DAEMON_PID=$!
  for _ in $(seq 1 300); do
    address="$(grep -o '"metrics_address": *"[^"]*"' "$ready" 2>/dev/null | sed 's/.*: *"\(.*\)"/\1/' || true)"
    [[ -n "$address" ]] && break
    kill -0 "$DAEMON_PID" 2>/dev/null || fail "daemon exited: $(cat "$WORK/daemon.err")"
    sleep 0.1
  done
  [[ -n "$address" ]] || fail "daemon not ready within 30 s: $(cat "$WORK/daemon.err")"
  # Some calls first, so the RPC histograms and counters carry samples.
  "$PYTHON" -m kvstore status --address "unix:$WORK/daemon/kvstore.sock" >/dev/null
  "$PYTHON" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
    "http://$address/metrics" >"$metrics"
  out="$(promtool check metrics <"$metrics" 2>&1)" || fail "promtool check metrics:
$out"
  [[ -z "$out" ]] || fail "promtool check metrics printed:
$out"
  echo "ok: promtool check metrics ($(grep -vc '^#' "$metrics") samples)"
  # The indexer's /metrics too (the dashboard's freshness row); one source,
  # never reachable, so the per-source series carry a sample.
  local ixout="$WORK/indexer.out" ixmetrics="$WORK/indexer-metrics.txt" ixaddress="" ixpid
  env -u KVSTORE_CONFIG "$PYTHON" -m kvstore.indexer --address 127.0.0.1:0 \
    --metrics-address 127.0.0.1:0 --source node=probe,endpoint=tcp://127.0.0.1:1 \
    >"$ixout" 2>"$WORK/indexer.err" &
  ixpid=$!
  for _ in $(seq 1 300); do
    ixaddress="$(sed -n 's/^kvstore indexer metrics on //p' "$ixout" 2>/dev/null || true)"
    [[ -n "$ixaddress" ]] && grep -q "listening on" "$ixout" && break
    kill -0 "$ixpid" 2>/dev/null || fail "indexer exited: $(cat "$WORK/indexer.err")"
    sleep 0.1
  done
  [[ -n "$ixaddress" ]] || fail "indexer not ready within 30 s: $(cat "$WORK/indexer.err")"
  sleep 0.5  # the ingestion thread takes the source up
  "$PYTHON" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
    "http://$ixaddress/metrics" >"$ixmetrics"
  kill -TERM "$ixpid"
  wait "$ixpid" || fail "indexer exited $? after SIGTERM (want 0): $(cat "$WORK/indexer.err")"
  out="$(promtool check metrics <"$ixmetrics" 2>&1)" || fail "promtool check metrics (indexer):
$out"
  [[ -z "$out" ]] || fail "promtool check metrics (indexer) printed:
$out"
  echo "ok: promtool check metrics on the indexer ($(grep -vc '^#' "$ixmetrics") samples)"
  cat "$ixmetrics" >>"$metrics"
  "$PYTHON" "$DEPLOY/checks.py" metric-names "$DEPLOY/grafana/kvstore-dashboard.json" "$metrics"
  kill -TERM "$DAEMON_PID"
  wait "$DAEMON_PID" || fail "daemon exited $? after SIGTERM (want 0): $(cat "$WORK/daemon.err")"
  DAEMON_PID=""
}

ALL_STEPS=(systemd render yaml kubernetes same configs dashboard metrics)
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=("${ALL_STEPS[@]}")
cd "$ROOT"
for s in "${steps[@]}"; do
  case "$s" in
    systemd | render | yaml | kubernetes | same | configs | dashboard | metrics) "check_$s" ;;
    *) fail "unknown step $s (steps: ${ALL_STEPS[*]})" ;;
  esac
done
echo "deploy/validate.sh: all ${#steps[@]} steps passed (${steps[*]})"
