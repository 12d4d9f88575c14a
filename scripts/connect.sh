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
  command -v java >/dev/null || die "java (17 or later) is needed to run Kafka Connect"
  mvn_jars "$LIB" "Kafka Connect and Debezium's JDBC sink"
}

case "${1:-}" in
  fetch) fetch ;;
  lib) echo "$LIB" ;;
  *) die "usage: scripts/connect.sh fetch | lib" ;;
esac
