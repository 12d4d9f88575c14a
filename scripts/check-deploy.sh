#!/usr/bin/env bash
# `make deploy-check`: validates the deployment examples under deploy/ offline (no cluster, no
# schema download; the Go module proxy only when the checker's modules are not cached yet).
#
#   1. builds deploy/check (Go: k8s.io/api's typed structs, sigs.k8s.io/yaml) into
#      target/deploy-check/ and runs it on deploy/kubernetes and deploy/systemd: every manifest
#      decoded strictly by its apiVersion/kind, then our rules (see deploy/check/rules.go);
#   2. `systemd-analyze verify` on the unit (when installed: Debian's systemd package), on a
#      copy whose ExecStart is a stub, since the engine is not installed here; any warning
#      (an unknown key, a bad value) fails;
#   3. proves both can fail: deliberately broken copies (a misspelt field, a probe on a port
#      the container lacks, readiness on /healthz, a grace period below the revoke deadline,
#      a budget that selects no pod, an unknown kind, a misspelt unit key) must each be
#      refused, for the reason expected.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=$ROOT/target/deploy-check

say() { printf '==> %s\n' "$*"; }
die() { printf 'check-deploy: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null 2>&1 || die "no go toolchain (Go 1.26, https://go.dev/dl/)"
mkdir -p "$OUT"
say "building the checker (deploy/check)"
(cd deploy/check && go build -o "$OUT/check" .)

say "checking deploy/kubernetes and deploy/systemd"
"$OUT/check" -k deploy/kubernetes -u deploy/systemd/effectively.service

# systemd-analyze verify on a copy of $1 whose ExecStart runs a stub; prints its complaints.
verify_unit() {
  local dir=$OUT/unit
  rm -rf "$dir" && mkdir -p "$dir/bin"
  printf '#!/bin/sh\nexit 0\n' > "$dir/bin/effectively" && chmod 755 "$dir/bin/effectively"
  sed "s|^ExecStart=/usr/local/bin/effectively|ExecStart=$dir/bin/effectively|" "$1" \
    > "$dir/effectively.service"
  systemd-analyze verify "$dir/effectively.service" 2>&1 || echo "systemd-analyze exited $?"
}

if command -v systemd-analyze >/dev/null 2>&1; then
  say "systemd-analyze verify deploy/systemd/effectively.service"
  complaints=$(verify_unit deploy/systemd/effectively.service)
  [ -z "$complaints" ] || die "systemd-analyze verify: $complaints"
else
  say "no systemd-analyze here (Debian package systemd): the unit's keys are checked by deploy/check only"
fi

# A copy of deploy/ with `$2` (a sed script) applied to `$1`, which the checker must refuse
# with a message matching `$3`.
refused() {
  local file=$1 edit=$2 expect=$3 copy=$OUT/broken
  rm -rf "$copy" && mkdir -p "$copy" && cp -r deploy/kubernetes deploy/systemd "$copy/"
  sed -i "$edit" "$copy/$file"
  cmp -s "deploy/$file" "$copy/$file" && die "the edit '$edit' changed nothing in $file"
  local out status=0
  out=$("$OUT/check" -k "$copy/kubernetes" -u "$copy/systemd/effectively.service" 2>&1) || status=$?
  [ "$status" -ne 0 ] || die "a broken $file ($edit) was accepted"
  grep -qF -- "$expect" <<<"$out" || die "a broken $file ($edit) was refused, but not for '$expect': $out"
  printf '    refused as expected: %s (%s)\n' "$file" "$expect"
}

say "broken copies must be refused"
refused kubernetes/deployment.yaml 's/terminationGracePeriodSeconds:/terminationGracePeriodSecond:/' \
  'unknown field "terminationGracePeriodSecond"'
refused kubernetes/deployment.yaml '/livenessProbe:/,/failureThreshold/ s/port: metrics/port: metric/' \
  'livenessProbe port metric is not a port of the container'
refused kubernetes/deployment.yaml '/readinessProbe:/,/failureThreshold/ s|path: /readyz|path: /healthz|' \
  'readinessProbe checks "/healthz"'
refused kubernetes/deployment.yaml 's/0.0.0.0:9464/127.0.0.1:9464/' \
  'listens on loopback'
refused kubernetes/deployment.yaml 's/replicas: 3/replicas: three/' \
  'cannot unmarshal string into Go struct field'
refused kubernetes/configmap.yaml 's/revoke_deadline = "20s"/revoke_deadline = "35s"/' \
  'terminationGracePeriodSeconds 40 is below worker.revoke_deadline 35s'
refused kubernetes/pdb.yaml '/selector:/,$ s/component: worker/component: workers/' \
  'PodDisruptionBudget effectively: its selector does not select'
refused kubernetes/service.yaml 's/targetPort: metrics/targetPort: metric/' \
  'targetPort metric is not a port'
refused kubernetes/pdb.yaml 's|apiVersion: policy/v1|apiVersion: policy/v1beta1|' \
  'unexpected apiVersion/kind "policy/v1beta1"'
refused systemd/effectively.service 's/^TimeoutStopSec=40s/TimeoutStopSec=25s/' \
  'TimeoutStopSec=25s is below'
refused systemd/effectively.service 's/^NoNewPrivileges=yes/NoNewPrivilege=yes/' \
  '[Service] NoNewPrivileges=""'

if command -v systemd-analyze >/dev/null 2>&1; then
  sed 's/^ProtectSystem=strict/ProtectSytem=strict/' deploy/systemd/effectively.service > "$OUT/typo.service"
  complaints=$(verify_unit "$OUT/typo.service")
  grep -q "Unknown key 'ProtectSytem'" <<<"$complaints" \
    || die "systemd-analyze verify accepted a misspelt key: '$complaints'"
  printf '    refused as expected: systemd-analyze verify (Unknown key)\n'
fi
say "deploy check passed"
