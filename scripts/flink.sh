#!/usr/bin/env bash
# Flink's exactly-once JDBC sink, the peer `loadgen bench` measures in its `flink` phase
# (loadgen/src/bench/flink/): peers/flink-xa (one Java class on Flink 1.20's local MiniCluster)
# built with mvn, its jar and every runtime jar of its pom (Flink, the Kafka and JDBC
# connectors, the PostgreSQL driver, log4j2) in target/peers/flink-xa/lib (git-ignored).
# loadgen starts, kills and restarts the JVM itself.
#
#   scripts/flink.sh build   build unless the folder holds the current pom's and sources' build
#   scripts/flink.sh lib     print the folder (FLINK_LIB for loadgen)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=$ROOT/target/peers/flink-xa
POM=$ROOT/peers/flink-xa/pom.xml
POM_SOURCES=$ROOT/peers/flink-xa/src
LOG_TAG=flink
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

LIB=$STACK_DIR/lib

build() {
  mkdir -p "$STACK_DIR"
  command -v java >/dev/null || die "java (17 or later) is needed to build and run the Flink peer"
  # The pom's <build><directory> is $STACK_DIR/build.
  mvn_jars "$LIB" "Flink 1.20 with its Kafka and JDBC connectors, and the peer's class" \
    "$STACK_DIR/build/peer-flink-xa.jar"
}

case "${1:-}" in
  build) build ;;
  lib) echo "$LIB" ;;
  *) die "usage: scripts/flink.sh build | lib" ;;
esac
