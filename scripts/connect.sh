#!/usr/bin/env bash
# Kafka Connect, the peer `loadgen bench` measures beside the batch drain (its `connect` phase):
# the jars of peers/connect/pom.xml (connect-runtime and connect-json at the broker's version,
# Debezium's JDBC sink, the PostgreSQL driver, log4j2) fetched with mvn into
# target/peers/connect/lib (git-ignored). loadgen starts and stops the worker itself.
#
#   scripts/connect.sh fetch   fetch the jars unless the folder holds the current pom's already
#   scripts/connect.sh lib     print the folder (CONNECT_LIB for loadgen)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=$ROOT/target/peers/connect
POM=$ROOT/peers/connect/pom.xml
LOG_TAG=connect
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

LIB=$STACK_DIR/lib

fetch() {
  mkdir -p "$STACK_DIR"
  # The same pom-hash stamp as the broker's jars (kafka_jars_current compares $POM's hash).
  kafka_jars_current "$LIB" && return 0
  command -v mvn >/dev/null || die "mvn is needed to fetch Kafka Connect's jars from Maven Central"
  command -v java >/dev/null || die "java (17 or later) is needed to run Kafka Connect"
  log "fetching Kafka Connect and Debezium's JDBC sink with mvn (cached in ~/.m2 and $LIB)"
  rm -rf "$LIB.tmp"
  mvn -B -q -f "$POM" dependency:copy-dependencies \
    -DoutputDirectory="$LIB.tmp" -DincludeScope=runtime >"$STACK_DIR/mvn.log" 2>&1 ||
    { tail -30 "$STACK_DIR/mvn.log" >&2; die "mvn could not fetch Kafka Connect's jars"; }
  kafka_pom_hash >"$LIB.tmp/.pom-hash"
  rm -rf "$LIB"
  mv "$LIB.tmp" "$LIB"
}

case "${1:-}" in
  fetch) fetch ;;
  lib) echo "$LIB" ;;
  *) die "usage: scripts/connect.sh fetch | lib" ;;
esac
