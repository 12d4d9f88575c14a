#!/usr/bin/env bash
# `make monitoring-check`: validates the monitoring files under grafana/ without any service.
#
#   - promtool check config grafana/prometheus.yml   (the scrape config, and its rule files)
#   - promtool check rules  grafana/alerts.yml        (every alert parses, has for/labels/annotations)
#   - promtool test rules   grafana/alerts_test.yml   (alerts fire on synthetic series, not on zeros)
#   - the dashboard is valid JSON, and every PromQL expression in it parses
#   - every alert's runbook anchor exists in docs/OPERATIONS.md
#
# promtool comes from Debian's `prometheus` package: installed here with apt-get when missing
# (as root). The package's maintainer scripts would start a Prometheus server where services
# can start; this script blocks that with a temporary policy-rc.d and stops any server the
# installation started anyway: only the promtool binary is wanted.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

say() { printf '==> %s\n' "$*"; }
die() { printf 'check-monitoring: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    die "need root (or sudo) to run: $*"
  fi
}

# The pids of running Prometheus servers (exact process name).
prometheus_pids() {
  pgrep -x prometheus 2>/dev/null | sort || true
}

APT_UPDATED=
apt_update() {
  if [ -z "$APT_UPDATED" ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
}

# Installs Debian packages without starting any service they ship.
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "no apt-get: install $* by hand"
  apt_update
  local policy=/usr/sbin/policy-rc.d placed=
  if [ ! -e "$policy" ]; then
    # 101: "action forbidden by policy"; invoke-rc.d and deb-systemd-invoke both honour it.
    as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
    placed=1
  fi
  local before after
  before=$(prometheus_pids)
  local status=0
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null || status=$?
  if [ -n "$placed" ]; then
    as_root rm -f "$policy"
  fi
  [ "$status" -eq 0 ] || die "apt-get install $* failed ($status)"
  # Belt and braces: stop a server the installation started after all, by its pid.
  after=$(prometheus_pids)
  local pid
  for pid in $(comm -13 <(printf '%s\n' "$before") <(printf '%s\n' "$after")); do
    say "stopping the Prometheus server the package started (pid $pid)"
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      as_root systemctl stop prometheus.service 2>/dev/null || true
    fi
    as_root kill -TERM "$pid" 2>/dev/null || true
  done
}

ensure_promtool() {
  command -v promtool >/dev/null 2>&1 && return
  say "promtool missing: installing it from Debian's packages"
  apt_update
  local pkg=prometheus
  local policy
  policy=$(apt-cache policy "$pkg" 2>/dev/null || true)
  if ! grep -q 'Candidate: [0-9]' <<<"$policy"; then
    # Another release may ship promtool elsewhere: look for a package that names it.
    pkg=$( (apt-cache search promtool || true) | awk 'NR == 1 { print $1 }')
    [ -n "$pkg" ] || die "no Debian package provides promtool"
  fi
  apt_install "$pkg"
  command -v promtool >/dev/null 2>&1 || die "installed $pkg but promtool is still missing"
}

ensure_jq() {
  command -v jq >/dev/null 2>&1 && return
  say "jq missing: installing it from Debian's packages"
  apt_install jq
}

ensure_promtool
ensure_jq
say "$(promtool --version 2>&1 | head -n 1)"

say "promtool check config grafana/prometheus.yml"
promtool check config grafana/prometheus.yml

say "promtool check rules grafana/alerts.yml"
promtool check rules grafana/alerts.yml

say "promtool test rules grafana/alerts_test.yml"
promtool test rules grafana/alerts_test.yml

DASHBOARD=grafana/dashboards/effectively.json
say "dashboard: valid JSON, and every expression parses"
jq empty "$DASHBOARD" || die "$DASHBOARD is not valid JSON"
[ "$(jq '.schemaVersion' "$DASHBOARD")" -ge 36 ] || die "$DASHBOARD: schemaVersion too old"
# promtool parses PromQL only inside rule files: wrap every panel query in a recording rule,
# with Grafana's variables replaced by what they expand to.
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
{
  echo 'groups:'
  echo '  - name: dashboard'
  echo '    rules:'
  jq -r '[.. | objects | select(has("expr")) | .expr] | to_entries[]
         | "      - record: dashboard:expr_\(.key)\n        expr: \(.value
             | gsub("\\$__rate_interval|\\$__interval|\\$__range"; "5m")
             | gsub("\\$consumer"; ".*") | @json)"' "$DASHBOARD"
} >"$TMP/dashboard-rules.yml"
count=$(grep -c 'record:' "$TMP/dashboard-rules.yml" || true)
[ "$count" -gt 0 ] || die "$DASHBOARD has no expression"
promtool check rules "$TMP/dashboard-rules.yml" >/dev/null ||
  { promtool check rules "$TMP/dashboard-rules.yml" || true; die "a dashboard expression does not parse"; }
echo "  $count expressions parse"

say "runbook anchors exist in docs/OPERATIONS.md"
missing=0
for anchor in $(sed -n 's/^ *runbook: *docs\/OPERATIONS\.md#\([a-z0-9-]*\) *$/\1/p' grafana/alerts.yml); do
  if ! grep -q "id=\"$anchor\"" docs/OPERATIONS.md; then
    echo "  missing anchor: $anchor" >&2
    missing=1
  fi
done
alerts=$(grep -c '^ *- alert:' grafana/alerts.yml)
runbooks=$(grep -c '^ *runbook: *docs/OPERATIONS\.md#' grafana/alerts.yml)
[ "$alerts" -eq "$runbooks" ] || die "$alerts alerts but $runbooks runbook annotations"
[ "$missing" -eq 0 ] || die "runbook anchors missing from docs/OPERATIONS.md"
echo "  $alerts alerts, each with a runbook section"

say "monitoring files OK"
