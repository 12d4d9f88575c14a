#!/usr/bin/env bash
# The cluster stack, for the failover scenarios: three Apache Kafka nodes (KRaft, each a broker
# and a controller, replication factor 3, min.insync.replicas 2) and a PostgreSQL 15 primary with
# a hot standby (synchronous by default), on loopback only, under .stack-cluster/ (git-ignored;
# STACK_DIR names another). Also reached as `STACK_TOPOLOGY=cluster scripts/stack.sh CMD`.
# Quiet: stderr carries errors only (CLUSTER_VERBOSE=1 shows progress); stdout only what a
# command reports, as said below. Nodes are numbered: Kafka 1..3, PostgreSQL 1 and 2.
#
#   up                  start what is not running (an old primary left by a failover is rebuilt
#                       as the standby); waits for 3 brokers in the metadata and the standby
#                       streaming; prints env. PG_REPLICATION=sync|async sets the mode (kept
#                       for later runs; default sync); KAFKA_NODE_HEAP (512m) each broker's heap
#   down                stop everything; leaves no process of theirs behind
#   status | logs       what runs where | paths of the log files
#   env                 print $STACK_DIR/env (KAFKA_BROKERS, DATABASE_URL, KAFKA_NODE1..3,
#                       PG_NODE1_URL, PG_NODE2_URL, STACK_TOPOLOGY, STACK_DIR)
#   reset               down, then delete the data (keeps the jars)
#   kafka CLASS ARGS... run a Kafka tool with the brokers' class path (its log goes to
#                       $STACK_DIR/kafka/logs/server.log, not to stderr)
#   kafka-signal N SIG  send SIG (TERM, KILL, STOP, CONT, ...) to Kafka node N; TERM and KILL
#                       return once it has exited (a paused node gets CONT after TERM)
#   kafka-start N       start Kafka node N unless it runs; returns once it is in the metadata
#   kafka-leader TOPIC PARTITION   print the node id leading it now (-1: none)
#   kafka-wait-isr [TOPIC]         until every partition (of TOPIC, or of every topic) has all
#                       its replicas in its ISR; fails after KAFKA_ISR_TIMEOUT (120) seconds
#   pg-primary | pg-standby        print 1 or 2: the node that is primary now (answers
#                       pg_is_in_recovery() = false; if none answers, the last one made primary,
#                       paused or down) | the other node
#   pg-switchover       stop the primary (-m fast), promote the standby; print the seconds from
#                       the stop to the first write the new primary accepted
#   pg-crash-failover   the same with the primary stopped -m immediate
#   pg-pause | pg-resume           SIGSTOP | SIGCONT the primary's postmaster and its children
#   pg-fence-failover   SIGKILL every process of the (paused) primary, promote; print seconds
#   pg-standby-stop | pg-standby-start   the standby down (sync: commits on the primary wait) |
#                       up again (returns once it streams)
#   pg-detach-standby | pg-attach-standby   the standby's WAL receiver off (primary_conninfo
#                       '', the standby keeps running) | on again (returns once it streams)
#   pg-replication sync|async      the primary's synchronous_standby_names, reloaded
#   pg-rebuild-standby  wipe the node that is not primary, pg_basebackup -R it from the primary,
#                       start it as the standby (roles may stay swapped); returns once it streams
#   pg-lag              print the bytes the standby's replay is behind the primary's WAL
#
# A promoted standby has no standby of its own, so promotion empties its
# synchronous_standby_names (commits would wait forever otherwise); pg-rebuild-standby restores
# the configured mode once the new standby streams.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=${STACK_DIR:-$ROOT/.stack-cluster}
KAFKA_HOME=$STACK_DIR/kafka
POM=$ROOT/scripts/kafka/pom.xml
PG_DB=${PG_DB:-effectively}
LOG_TAG=cluster
PG_DATA_KEY=$STACK_DIR
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"
log() { [ -z "${CLUSTER_VERBOSE:-}" ] || printf '[cluster] %s\n' "$*" >&2; }

NODES="1 2 3"
KAFKA_NODE_HEAP=${KAFKA_NODE_HEAP:-512m}

if [ -e "$STACK_DIR/pg" ] || [ -e "$KAFKA_HOME/server.properties" ]; then
  die "$STACK_DIR holds a single-node stack (scripts/stack.sh); the cluster needs a folder of its own (default $ROOT/.stack-cluster)"
fi
mkdir -p "$STACK_DIR"

# Commands that change the cluster run one at a time (the lock's descriptor is not inherited by
# the servers they start); the ones that only look do not wait.
case "${1:-}" in
  up | down | reset | kafka-start | pg-switchover | pg-crash-failover | pg-pause | pg-resume | \
    pg-fence-failover | pg-standby-stop | pg-standby-start | pg-detach-standby | \
    pg-attach-standby | pg-replication | pg-rebuild-standby)
    if [ -z "${CLUSTER_LOCKED:-}" ]; then
      CLUSTER_LOCKED=1 exec flock -o "$STACK_DIR/lock" "$0" "$@"
    fi
    ;;
esac

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f\n", b - a }'; }
pid_state() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1; }
# A process stopped by SIGSTOP (state T).
pid_paused() { [ "$(pid_state "$1")" = T ]; }
# Until none of the pids runs (a zombie, dead but not reaped yet by init, counts as gone).
wait_gone() {
  local i p alive
  for i in $(seq 1 "$((${2:-60} * 10))"); do
    alive=
    for p in $1; do
      if kill -0 "$p" 2>/dev/null && [ "$(pid_state "$p")" != Z ]; then alive=1; fi
    done
    [ -z "$alive" ] && return 0
    sleep 0.1
  done
  return 1
}

# ---------------------------------------------------------------------------------------------
# Kafka: node N listens on base + 2(N-1) (PLAINTEXT) and the port after it (CONTROLLER).
# ---------------------------------------------------------------------------------------------

kafka_node() { case "${1:-}" in 1 | 2 | 3) ;; *) die "no Kafka node '${1:-}' (1, 2 or 3)" ;; esac; }
node_dir() { echo "$KAFKA_HOME/node$1"; }
node_pidfile() { echo "$KAFKA_HOME/node$1/pid"; }
kafka_port() {
  [ -f "$KAFKA_HOME/port" ] || die "the cluster is not up; run: scripts/cluster.sh up"
  echo $(($(cat "$KAFKA_HOME/port") + 2 * ($1 - 1)))
}
kafka_addr() { echo "127.0.0.1:$(kafka_port "$1")"; }
kafka_all() {
  local n list=
  for n in $NODES; do list=${list:+$list,}$(kafka_addr "$n"); done
  echo "$list"
}
# The nodes that run and are not paused: the tools' bootstrap list (a paused node would take
# each of them a connection timeout).
kafka_live() {
  local n list=
  for n in $NODES; do
    if pid_alive "$(node_pidfile "$n")" && ! pid_paused "$(cat "$(node_pidfile "$n")")"; then
      list=${list:+$list,}$(kafka_addr "$n")
    fi
  done
  [ -n "$list" ] || die "no Kafka node is running"
  echo "$list"
}
kafka_any_running() {
  local n
  for n in $NODES; do pid_alive "$(node_pidfile "$n")" && return 0; done
  return 1
}

# The jars: a hard-linked copy of the single stack's cache when it holds the current ones
# (nothing to fetch, and either stack may re-fetch without breaking the other), else fetched.
cluster_jars() {
  local shared=$ROOT/.stack/kafka/lib
  kafka_jars_current "$KAFKA_HOME/lib" && return 0
  if kafka_jars_current "$shared"; then
    rm -rf "$KAFKA_HOME/lib.tmp"
    cp -al "$shared" "$KAFKA_HOME/lib.tmp" 2>/dev/null ||
      { rm -rf "$KAFKA_HOME/lib.tmp"; cp -a "$shared" "$KAFKA_HOME/lib.tmp"; }
    rm -rf "${KAFKA_HOME:?}/lib"
    mv "$KAFKA_HOME/lib.tmp" "$KAFKA_HOME/lib"
    return 0
  fi
  kafka_jars
}

kafka_pick_ports() {
  local base
  base=$(cat "$KAFKA_HOME/port" 2>/dev/null || echo 19092)
  if ! kafka_any_running; then
    local i
    for i in 0 1 2 3 4 5; do
      if port_busy "$((base + i))"; then base=$(free_port_from 19092 6); break; fi
    done
  fi
  echo "$base" >"$KAFKA_HOME/port"
}

kafka_properties() {
  local n=$1 port base dir
  port=$(kafka_port "$n")
  base=$(cat "$KAFKA_HOME/port")
  dir=$(node_dir "$n")
  cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$n
controller.quorum.voters=1@127.0.0.1:$((base + 1)),2@127.0.0.1:$((base + 3)),3@127.0.0.1:$((base + 5))
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$((port + 1))
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
auto.create.topics.enable=false
offsets.topic.replication.factor=3
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
log.retention.hours=168
# Faster failure detection than the defaults (9 s session, 2 s heartbeat, 30 s replica lag), so
# that a killed or paused node loses its leaderships after about 4 s and a stuck follower leaves
# the ISR after 10 s: a scenario sees the failover within its run. Not lower: with two cores
# shared by three JVMs, PostgreSQL and the engine, a busy node must not be fenced by mistake.
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=4000
replica.lag.time.max.ms=10000
EOF
}

kafka_node_spawn() {
  local n=$1 dir
  dir=$(node_dir "$n")
  pid_alive "$dir/pid" && return 0
  mkdir -p "$dir/logs"
  kafka_properties "$n"
  if [ ! -f "$dir/data/meta.properties" ]; then
    [ -s "$KAFKA_HOME/cluster.id" ] ||
      kafka_java kafka.tools.StorageTool random-uuid >"$KAFKA_HOME/cluster.id"
    kafka_format "$dir/server.properties" "$(cat "$KAFKA_HOME/cluster.id")" "$dir/logs/format.log"
  fi
  log "starting kafka node $n on $(kafka_addr "$n") (logs: $dir/logs)"
  kafka_spawn "$dir/server.properties" "$dir/logs" "$dir/pid" "$KAFKA_NODE_HEAP"
}

# The admin client config of BrokerApiVersionsCommand: short timeouts, so that a paused node (its
# TCP connection accepted, never answered) is given up on after 3 s, not 30.
admin_config() {
  local f=$KAFKA_HOME/admin.properties
  [ -f "$f" ] || printf 'request.timeout.ms=3000\ndefault.api.timeout.ms=8000\nsocket.connection.setup.timeout.ms=2000\n' >"$f"
  echo "$f"
}

# The brokers a node's metadata lists (registered and not fenced), one id a line.
kafka_brokers_seen() {
  kafka_java org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$1" \
    --command-config "$(admin_config)" 2>/dev/null |
    sed -n 's/^[^ ]* (id: \([0-9]*\) .*/\1/p'
}
kafka_node_ready() { kafka_brokers_seen "$(kafka_addr "$1")" | grep -qx "$1"; }
kafka_node_wait() { kafka_wait "$(node_pidfile "$1")" "$(node_dir "$1")/logs" kafka_node_ready "$1"; }

kafka_up() {
  mkdir -p "$KAFKA_HOME/logs"
  cluster_jars
  kafka_pick_ports
  local n i started=
  for n in $NODES; do
    if ! pid_alive "$(node_pidfile "$n")"; then
      kafka_node_spawn "$n"
      started="$started $n"
    fi
  done
  for n in $started; do kafka_node_wait "$n"; done
  for i in $(seq 1 60); do
    [ "$(kafka_brokers_seen "$(kafka_all)" | sort -u | wc -l)" = 3 ] && return 0
    sleep 1
  done
  die "the metadata does not show 3 brokers after 60 s"
}

kafka_down() {
  local n pid
  # All three at once (a paused one resumed first, to hear SIGTERM), then each waited for.
  for n in $NODES; do
    if pid_alive "$(node_pidfile "$n")"; then
      pid=$(cat "$(node_pidfile "$n")")
      kill -CONT "$pid" 2>/dev/null || true
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for n in $NODES; do stop_pidfile "$(node_pidfile "$n")" "kafka node $n"; done
}

kafka_signal() {
  kafka_node "$1"
  local sig=${2:-} pidfile pid
  sig=${sig#SIG}
  sig=${sig^^}
  [ -n "$sig" ] || die "usage: kafka-signal N SIGNAL"
  pidfile=$(node_pidfile "$1")
  pid_alive "$pidfile" || die "kafka node $1 is not running"
  pid=$(cat "$pidfile")
  kill -s "$sig" "$pid" || die "kill -s $sig $pid failed"
  case "$sig" in
    TERM | INT | KILL)
      [ "$sig" = KILL ] || kill -CONT "$pid" 2>/dev/null || true
      wait_gone "$pid" 60 || die "kafka node $1 (pid $pid) did not exit within 60 s of SIG$sig"
      rm -f "$pidfile"
      ;;
  esac
}

kafka_start() {
  kafka_node "$1"
  local pidfile
  pidfile=$(node_pidfile "$1")
  if pid_alive "$pidfile" && pid_paused "$(cat "$pidfile")"; then
    die "kafka node $1 is paused (SIGSTOP); resume it: kafka-signal $1 CONT"
  fi
  cluster_jars
  kafka_node_spawn "$1"
  kafka_node_wait "$1"
}

# The partitions' leaders and ISRs, one "TOPIC PARTITION LEADER REPLICAS ISR" line each (ids
# comma-separated, leader -1 when there is none), from the admin client's describeTopics alone:
# TopicCommand --describe also lists reassignments, through the node the metadata names as the
# controller (any broker, in KRaft), and times out while that one is paused and not fenced yet.
# Compiled once into $KAFKA_HOME/tool; the same short timeouts as admin_config.
partitions_tool() {
  local dir=$KAFKA_HOME/tool src
  src=$(cat <<'JAVA'
import java.util.*;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.common.*;
import org.apache.kafka.common.errors.UnknownTopicOrPartitionException;

public class ClusterPartitions {
  public static void main(String[] args) throws Exception {
    Properties p = new Properties();
    p.put("bootstrap.servers", args[0]);
    p.put("request.timeout.ms", "3000");
    p.put("default.api.timeout.ms", "10000");
    p.put("socket.connection.setup.timeout.ms", "2000");
    p.put("socket.connection.setup.timeout.max.ms", "2000");
    try (Admin admin = Admin.create(p)) {
      Collection<String> topics = args.length > 1 ? List.of(args[1])
          : admin.listTopics(new ListTopicsOptions().listInternal(true)).names().get();
      Map<String, TopicDescription> all = new TreeMap<>(admin.describeTopics(topics).allTopicNames().get());
      for (TopicDescription t : all.values())
        for (TopicPartitionInfo i : t.partitions())
          System.out.println(t.name() + " " + i.partition() + " "
              + (i.leader() == null ? -1 : i.leader().id()) + " " + ids(i.replicas()) + " " + ids(i.isr()));
    } catch (ExecutionException e) {
      System.err.println(e.getCause());
      System.exit(e.getCause() instanceof UnknownTopicOrPartitionException ? 2 : 1);
    }
  }

  static String ids(List<Node> nodes) {
    StringJoiner j = new StringJoiner(",");
    for (Node n : nodes) j.add(String.valueOf(n.id()));
    return j.length() == 0 ? "-" : j.toString();
  }
}
JAVA
)
  if [ ! -f "$dir/ClusterPartitions.class" ] || [ "$src" != "$(cat "$dir/ClusterPartitions.java" 2>/dev/null)" ]; then
    mkdir -p "$dir"
    printf '%s\n' "$src" >"$dir/ClusterPartitions.java"
    javac -cp "$KAFKA_HOME/lib/*" -d "$dir" "$dir/ClusterPartitions.java" >&2 || die "compiling ClusterPartitions failed"
  fi
  echo "$dir"
}

# kafka_partitions [TOPIC]: the lines above, tried again with a new client (fresh metadata) for up
# to 45 s; an unknown topic fails at once.
kafka_partitions() {
  local deadline=$((SECONDS + 45)) tool out rc
  tool=$(partitions_tool)
  while :; do
    rc=0
    out=$(KAFKA_CLASSPATH_EXTRA=$tool kafka_java ClusterPartitions "$(kafka_live)" "$@" 2>&1) || rc=$?
    [ "$rc" = 0 ] && { printf '%s\n' "$out"; return 0; }
    if [ "$rc" = 2 ] || [ "$SECONDS" -ge "$deadline" ]; then
      printf '%s\n' "$out" >&2
      return 1
    fi
    sleep 0.5
  done
}

kafka_leader() {
  [ $# = 2 ] || die "usage: kafka-leader TOPIC PARTITION"
  local out leader
  out=$(kafka_partitions "$1") || die "describing topic $1 failed"
  leader=$(printf '%s\n' "$out" | awk -v p="$2" '$2 == p { print $3 }')
  [ -n "$leader" ] || die "topic $1 has no partition $2"
  echo "$leader"
}

# Every partition has a leader and as many replicas in its ISR as it has replicas.
isr_complete() {
  awk '{ lines++; if ($3 == "-1" || split($4, r, ",") != split($5, i, ",") || $5 == "-") bad++ }
    END { exit !(lines > 0 && bad == 0) }'
}

kafka_wait_isr() {
  local deadline=$((SECONDS + ${KAFKA_ISR_TIMEOUT:-120})) out=
  while :; do
    if out=$(kafka_partitions ${1:+"$1"} 2>/dev/null) && printf '%s\n' "$out" | isr_complete; then
      return 0
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      printf '%s\n' "$out" >&2
      die "not every partition${1:+ of $1} has its replicas in sync after ${KAFKA_ISR_TIMEOUT:-120} s"
    fi
    sleep 1
  done
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL: node 1 on base, node 2 on base + 1; which one is primary is in pg.primary.
# ---------------------------------------------------------------------------------------------

pg_node() { case "${1:-}" in 1 | 2) ;; *) die "no PostgreSQL node '${1:-}' (1 or 2)" ;; esac; }
pg_port() {
  [ -f "$STACK_DIR/pg.port" ] || die "the cluster is not up; run: scripts/cluster.sh up"
  echo $(($(cat "$STACK_DIR/pg.port") + $1 - 1))
}
pg_url() { echo "postgres://postgres@127.0.0.1:$(pg_port "$1")/${2:-$PG_DB}"; }
pg_dir() { pg_data_dir "pg$1"; }
other() { echo $((3 - $1)); }
recorded_primary() { cat "$STACK_DIR/pg.primary" 2>/dev/null || echo 1; }
replication_mode() { cat "$STACK_DIR/pg.replication" 2>/dev/null || echo sync; }
# pgq N SQL: one statement as postgres on node N, unaligned; 3 s to connect (a paused server
# accepts the TCP connection and then never answers).
pgq() {
  psql "postgres://postgres@127.0.0.1:$(pg_port "$1")/postgres?connect_timeout=3" \
    -XtAq -v ON_ERROR_STOP=1 -c "$2"
}
pg_ctl_node() {
  local n=$1
  shift
  as_postgres "$(pg_bin)/pg_ctl" -D "$(pg_dir "$n")" "$@"
}
pg_running() { [ -e "$STACK_DIR/pg$1" ] && pg_ctl_node "$1" status >/dev/null 2>&1; }
pg_postmaster() {
  local pid
  [ -e "$STACK_DIR/pg$1" ] || return 1
  pid=$(head -1 "$(pg_dir "$1")/postmaster.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}
# The postmaster and its children, the postmaster first (words: lists of pids are split on
# purpose below).
# shellcheck disable=SC2046,SC2086
pg_pids() {
  local pm
  pm=$(pg_postmaster "$1") || return 0
  echo "$pm" $(pgrep -P "$pm" || true)
}
pg_answers_as() { [ "$(pgq "$1" 'select pg_is_in_recovery()' 2>/dev/null)" = "$2" ]; }

pg_node_start() {
  pg_running "$1" && return 0
  log "starting postgresql node $1 on 127.0.0.1:$(pg_port "$1")"
  # cluster_name: in the processes' titles, "stack-cluster-pg1: walsender ..." (the folder's name).
  pg_start "$(pg_dir "$1")" "$(pg_port "$1")" "-c cluster_name=$(basename "$STACK_DIR" | tr -c 'A-Za-z0-9_\n-' _ | sed 's/^_//')-pg$1 -c wal_level=replica \
    -c hot_standby=on -c max_wal_senders=10 -c max_replication_slots=10 -c wal_keep_size=1GB"
}

pg_stop() {
  pg_running "$1" || return 0
  log "stopping postgresql node $1 (-m $2)"
  pg_ctl_node "$1" -m "$2" -w -t 60 stop >/dev/null
}

# pg_set N GUC VALUE: ALTER SYSTEM on node N (a standby too) and reload.
pg_set() {
  pgq "$1" "alter system set $2 = '$3'" >/dev/null
  pgq "$1" 'select pg_reload_conf()' >/dev/null
}

standby_conninfo() { echo "host=127.0.0.1 port=$(pg_port "$1") user=postgres application_name=standby"; }

pg_apply_mode() {
  local names=
  [ "$(replication_mode)" = sync ] && names=standby
  pg_set "$1" synchronous_standby_names "$names"
}

replication_state() {
  pgq "$1" "select state || ' ' || sync_state from pg_stat_replication where application_name = 'standby'" 2>/dev/null || true
}

# Until the primary P sees the standby streaming, with the configured sync_state.
pg_wait_streaming() {
  local want i
  want="streaming $(replication_mode)"
  for i in $(seq 1 120); do
    [ "$(replication_state "$1")" = "$want" ] && return 0
    sleep 0.5
  done
  die "the standby does not stream to node $1 ($want) after 60 s: $(replication_state "$1"); try pg-rebuild-standby"
}

# pg_make_standby S P: node S's folder wiped and remade from the primary P, started as its standby.
pg_make_standby() {
  local s=$1 p=$2 data
  pg_answers_as "$p" f || die "node $p does not answer as primary; not wiping node $s"
  pg_kill "$s"
  data=$(pg_dir "$s")
  log "rebuilding postgresql node $s from node $p (pg_basebackup)"
  find "$data" -mindepth 1 -delete
  chmod 700 "$data"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$data"
  as_postgres "$(pg_bin)/pg_basebackup" -D "$data" -d "$(standby_conninfo "$p")" -R -X stream \
    -c fast >"$STACK_DIR/basebackup.log" 2>&1 ||
    { cat "$STACK_DIR/basebackup.log" >&2; die "pg_basebackup from node $p failed"; }
  pg_node_start "$s"
}

# shellcheck disable=SC2086
# SIGKILL every process of node N (stopped first, so that the postmaster forks no more).
pg_kill() {
  local pm pids
  pm=$(pg_postmaster "$1") || return 0
  kill -STOP "$pm" 2>/dev/null || true
  pids=$(pg_pids "$1")
  log "killing postgresql node $1: $pids"
  kill -KILL $pids 2>/dev/null || true
  wait_gone "$pids" 30 || die "processes of postgresql node $1 survived SIGKILL: $pids"
  rm -f "$STACK_DIR/pg.paused"
}

# shellcheck disable=SC2086
pg_signal_all() {
  local pids
  pids=$(pg_pids "$1")
  [ -n "$pids" ] || die "postgresql node $1 is not running"
  kill -"$2" $pids
}

# pg_promote S: the standby S becomes the primary; returns once it has committed a write.
pg_promote() {
  local s=$1 i
  pg_answers_as "$s" t || die "node $s is not a running standby; nothing to promote"
  pg_set "$s" synchronous_standby_names ''
  pg_ctl_node "$s" -w -t 60 promote >/dev/null
  echo "$s" >"$STACK_DIR/pg.primary"
  for i in $(seq 1 600); do
    pg_answers_as "$s" f && pgq "$s" 'select txid_current()' >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "node $s was promoted but accepts no write after 60 s"
}

# pg_failover HOW: the primary stopped (fast, immediate) or killed (kill), the standby promoted;
# prints the seconds from the fault to the new primary's first write.
pg_failover() {
  local p s t0
  p=$(recorded_primary)
  s=$(other "$p")
  pg_answers_as "$s" t || die "node $s is not a running standby; no failover possible"
  t0=$(now)
  case "$1" in
    kill) pg_kill "$p" ;;
    *) pg_stop "$p" "$1" ;;
  esac
  pg_promote "$s"
  elapsed "$t0"
}

pg_primary_now() {
  local rec n
  rec=$(recorded_primary)
  for n in "$rec" "$(other "$rec")"; do
    pg_answers_as "$n" f && { echo "$n"; return 0; }
  done
  echo "$rec"
}

pg_set_mode() {
  case "${1:-}" in sync | async) ;; *) die "replication mode '${1:-}': sync or async" ;; esac
  echo "$1" >"$STACK_DIR/pg.replication"
}

pg_pick_ports() {
  local base
  base=$(cat "$STACK_DIR/pg.port" 2>/dev/null || echo 15432)
  if ! pg_running 1 && ! pg_running 2 && { port_busy "$base" || port_busy "$((base + 1))"; }; then
    base=$(free_port_from 15432 2)
  fi
  echo "$base" >"$STACK_DIR/pg.port"
}

pg_up() {
  pg_install
  pg_set_mode "${PG_REPLICATION:-$(replication_mode)}"
  pg_pick_ports
  local p s fresh=
  p=$(recorded_primary)
  s=$(other "$p")
  if [ ! -f "$(pg_dir "$p")/PG_VERSION" ]; then
    pg_initdb "$(pg_dir "$p")" "$STACK_DIR/initdb.log"
    fresh=1
  fi
  [ -f "$(pg_dir "$p")/standby.signal" ] && die "node $p, recorded as primary, is a standby"
  pg_node_start "$p"
  pg_answers_as "$p" f || die "node $p, the primary, does not answer (paused? pg-resume)"
  echo "$p" >"$STACK_DIR/pg.primary"
  pg_create_db "$(pg_port "$p")"
  # The other node streams from this one: remade unless it is a standby already (an old
  # primary after a failover is not, and must not come back as a second primary).
  if [ -n "$fresh" ] || [ ! -f "$(pg_dir "$s")/standby.signal" ]; then
    pg_make_standby "$s" "$p"
  else
    pg_node_start "$s"
    pg_set "$s" primary_conninfo "$(standby_conninfo "$p")"
  fi
  pg_apply_mode "$p"
  pg_wait_streaming "$p"
}

pg_down() {
  local n
  for n in "$(recorded_primary)" "$(other "$(recorded_primary)")"; do
    [ -n "$(pg_pids "$n")" ] && pg_signal_all "$n" CONT
    pg_stop "$n" fast || pg_stop "$n" immediate
  done
  rm -f "$STACK_DIR/pg.paused"
}

# ---------------------------------------------------------------------------------------------

write_env() {
  cat >"$STACK_DIR/env" <<EOF
export KAFKA_BROKERS=$(kafka_all)
export DATABASE_URL=postgres://postgres@127.0.0.1:$(pg_port 1),127.0.0.1:$(pg_port 2)/$PG_DB?target_session_attrs=read-write
export KAFKA_NODE1=$(kafka_addr 1)
export KAFKA_NODE2=$(kafka_addr 2)
export KAFKA_NODE3=$(kafka_addr 3)
export PG_NODE1_URL=$(pg_url 1)
export PG_NODE2_URL=$(pg_url 2)
export STACK_TOPOLOGY=cluster
export STACK_DIR=$STACK_DIR
EOF
}

status() {
  local n pidfile state
  for n in $NODES; do
    pidfile=$(node_pidfile "$n")
    if pid_alive "$pidfile"; then
      state=running
      pid_paused "$(cat "$pidfile")" && state=paused
      echo "kafka node $n:      $state, pid $(cat "$pidfile"), $(kafka_addr "$n")"
    else
      echo "kafka node $n:      stopped"
    fi
  done
  for n in 1 2; do
    if [ ! -f "$STACK_DIR/pg.port" ] || ! pg_running "$n"; then
      state=stopped
    elif pid_paused "$(pg_postmaster "$n")"; then
      state=paused
    elif pg_answers_as "$n" f; then
      state=primary
    elif pg_answers_as "$n" t; then
      state=standby
    else
      state="running, not answering"
    fi
    [ -f "$STACK_DIR/pg.port" ] && state="$state, $(pg_url "$n")"
    echo "postgresql node $n: $state"
  done
  if [ -f "$STACK_DIR/pg.port" ]; then
    state=$(replication_state "$(recorded_primary)")
    echo "replication:       $(replication_mode), standby: ${state:-not streaming}"
  fi
}

case "${1:-}" in
  up)
    kafka_up
    pg_up
    write_env
    cat "$STACK_DIR/env"
    ;;
  down)
    pids=
    for n in $NODES; do
      if pid_alive "$(node_pidfile "$n")"; then pids="$pids $(cat "$(node_pidfile "$n")")"; fi
    done
    for n in 1 2; do pids="$pids $(pg_pids "$n")"; done
    kafka_down
    pg_down
    wait_gone "$pids" 30 || die "processes left behind: $(ps -o pid=,args= -p "${pids// /,}" 2>/dev/null || true)"
    rm -f "$STACK_DIR/env"
    ;;
  status) status ;;
  env) cat "$STACK_DIR/env" 2>/dev/null || die "the cluster is not up; run: scripts/cluster.sh up" ;;
  logs)
    for n in $NODES; do echo "$(node_dir "$n")/logs/server.log"; done
    for n in 1 2; do
      if [ -e "$STACK_DIR/pg$n" ]; then echo "$(pg_dir "$n")/server.log"; fi
    done
    ;;
  reset)
    "$0" down
    rm -rf "$KAFKA_HOME"/node[123] "$KAFKA_HOME/logs" "$KAFKA_HOME/cluster.id" "$KAFKA_HOME/port"
    for n in 1 2; do
      if [ -e "$STACK_DIR/pg$n" ]; then rm -rf "$(pg_dir "$n")"; rm -rf "$STACK_DIR/pg$n"; fi
    done
    rm -f "$STACK_DIR"/pg.* "$STACK_DIR"/*.log
    ;;
  kafka)
    shift
    cluster_jars
    kafka_java "$@"
    ;;
  kafka-signal) kafka_signal "${2:-}" "${3:-}" ;;
  kafka-start) kafka_start "${2:-}" ;;
  kafka-leader) shift; kafka_leader "$@" ;;
  kafka-wait-isr) kafka_wait_isr "${2:-}" ;;
  pg-primary) pg_primary_now ;;
  pg-standby) other "$(pg_primary_now)" ;;
  pg-switchover) pg_failover fast ;;
  pg-crash-failover) pg_failover immediate ;;
  pg-fence-failover) pg_failover kill ;;
  pg-pause)
    p=$(recorded_primary)
    pm=$(pg_postmaster "$p") || die "postgresql node $p (primary) is not running"
    kill -STOP "$pm"
    pg_signal_all "$p" STOP
    echo "$p" >"$STACK_DIR/pg.paused"
    ;;
  pg-resume)
    p=$(cat "$STACK_DIR/pg.paused" 2>/dev/null || recorded_primary)
    # The children first, the postmaster last: it finds them all as it left them.
    if pm=$(pg_postmaster "$p"); then
      # shellcheck disable=SC2046
      kill -CONT $(pgrep -P "$pm" || true) 2>/dev/null || true
      kill -CONT "$pm"
    fi
    rm -f "$STACK_DIR/pg.paused"
    ;;
  pg-standby-stop) pg_stop "$(other "$(recorded_primary)")" fast ;;
  pg-standby-start | pg-attach-standby)
    p=$(recorded_primary)
    s=$(other "$p")
    pg_node_start "$s"
    pg_set "$s" primary_conninfo "$(standby_conninfo "$p")"
    pg_wait_streaming "$p"
    ;;
  pg-detach-standby)
    p=$(recorded_primary)
    s=$(other "$p")
    pg_set "$s" primary_conninfo ''
    for i in $(seq 1 100); do
      [ -z "$(replication_state "$p")" ] && [ -z "$(pgq "$s" 'select pid from pg_stat_wal_receiver')" ] && break
      sleep 0.1
    done
    [ -z "$(replication_state "$p")" ] || die "the standby still streams after 10 s"
    ;;
  pg-replication)
    pg_set_mode "${2:-}"
    p=$(recorded_primary)
    pg_apply_mode "$p"
    if [ -n "$(replication_state "$p")" ]; then pg_wait_streaming "$p"; fi
    ;;
  pg-rebuild-standby)
    p=$(recorded_primary)
    pg_make_standby "$(other "$p")" "$p"
    pg_apply_mode "$p"
    pg_wait_streaming "$p"
    ;;
  pg-lag)
    p=$(recorded_primary)
    s=$(other "$p")
    primary_lsn=$(pgq "$p" 'select pg_current_wal_lsn()') || die "node $p (primary) does not answer"
    standby_lsn=$(pgq "$s" 'select pg_last_wal_replay_lsn()') || die "node $s (standby) does not answer"
    [ -n "$standby_lsn" ] || die "node $s is not a standby"
    pgq "$p" "select pg_wal_lsn_diff('$primary_lsn', '$standby_lsn')::bigint"
    ;;
  *)
    sed -n '2,45p' "$0" >&2
    exit 2
    ;;
esac
