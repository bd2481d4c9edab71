#!/usr/bin/env bash
# An emulated cluster on this machine, for running MPI jobs across "nodes" without a second
# machine:  scripts/cluster.sh start|mpiexec|status|bytes|stop NAME ...
#
# Each node NAME-n0 .. NAME-n{N-1} is a network namespace (loopback up, one veth `eth0` with
# the address SUBNET.(i+2)/24) joined to a bridge in the root namespace (SUBNET.1/24); both
# ends of every veth are shaped with a tbf qdisc (default 1gbit). Ranks run in their node's
# namespace and in a UTS namespace of their own whose hostname is the node's name, so MPI sees
# N hosts (Get_processor_name, Split_type(COMM_TYPE_SHARED)) and the data between nodes goes
# over the shaped links. A generated launcher, an `ssh` replacement, is what MPICH's hydra
# and Open MPI's PRRTE call to start their daemons on a node.
#
# start NAME NODES [--rate 1gbit|none] [--burst 256kb] [--subnet 10.213.7]
#         stops a cluster NAME first when one exists; on failure removes what it made.
#         State (node list, addresses, launcher) in $MPIFUSION_CLUSTER_DIR/NAME
#         (default /run/mpifusion-cluster/NAME).
# mpiexec NAME RANKS_PER_NODE [--mpi mpich|openmpi|impi] [--mpiexec PATH] -- CMD...
#         CMD on every node, ranks numbered node by node; prints nothing but the job's
#         output, exits with the job's code. MPICH gets UCX_TLS=tcp,self (its UCX netmod
#         otherwise moves the data through shared memory, namespaces or not); Open MPI gets
#         ob1 with the tcp, sm and self BTLs (sm only within a node) and yields when idle
#         (the nodes share this machine's cores); Intel MPI its hydra's
#         -iface on the bridge, libfabric's tcp provider and I_MPI_WAIT_MODE=1 (the
#         same reason). PATH defaults to the
#         repository's .venv (MPICH), $MPIFUSION_OPENMPI_VENV / .venv-ompi (Open MPI) or
#         $MPIFUSION_IMPI_VENV / .venv-impi (Intel MPI).
# status NAME  the nodes, addresses, qdiscs and processes; exit 0 when every part is there
# bytes NAME   one line per node: NODE SENT RECEIVED (bytes over its link, from the bridge
#              side's /sys/class/net/*/statistics: SENT = what the node sent)
# stop NAME    kills the processes still in the nodes, removes the namespaces, veths,
#              bridge (their qdiscs with them) and the state folder; idempotent.
#
# Needs root, iproute2 (ip netns, veth, bridge), tc with tbf, and util-linux's unshare.
# Namespaces made inside a private mount namespace (`unshare -m`, as the test suite runs) are
# visible only there: run stop there too (the links and processes are found from anywhere).
# Exit codes: 0 ok, 1 failed (or not running, for status), 2 bad usage, 3 cannot run here
# (not root, no ip netns): the caller should skip, not fail.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE_ROOT=${MPIFUSION_CLUSTER_DIR:-/run/mpifusion-cluster}
PROG=cluster

say() { echo "$PROG: $*"; }
die() { echo "$PROG: error: $1" >&2; exit "${2:-1}"; }
usage() {
  cat >&2 <<EOF
usage: $0 start NAME NODES [--rate 1gbit|none] [--burst 256kb] [--subnet 10.213.7]
       $0 mpiexec NAME RANKS_PER_NODE [--mpi mpich|openmpi|impi] [--mpiexec PATH] -- CMD...
       $0 status|bytes|stop NAME
EOF
  exit 2
}

check_name() {  # a hostname label: letters, digits, '-'; short enough for NAME-nNNN
  [[ ${1:-} =~ ^[A-Za-z0-9][A-Za-z0-9-]{0,39}$ ]] ||
    die "NAME: expected letters, digits and '-' (at most 40, not starting with '-'), got '${1:-}'" 2
}

names() {  # names NAME: the globals every command derives from NAME alone (nothing read)
  NAME=$1
  STATE=$STATE_ROOT/$NAME
  # interface names are at most 15 characters: a tag from NAME's checksum
  TAG=mf$(printf '%08x' "$(printf '%s' "$NAME" | cksum | cut -d' ' -f1)")
  BRIDGE=${TAG}b
}

need_tools() {
  [ "$(id -u)" = 0 ] || die "not root: network namespaces need root" 3
  local t
  for t in ip tc unshare; do
    command -v "$t" >/dev/null || die "$t not found (iproute2, util-linux)" 3
  done
}

# --- what exists now (from the system, not the state folder) --------------------------------

node_netns() {  # the network namespaces NAME-n<i> (this mount namespace's /run/netns)
  { ip netns list 2>/dev/null || true; } | awk '{print $1}' | grep -E "^${NAME}-n[0-9]+\$" || true
}

our_links() {  # the interfaces in the root namespace that belong to NAME (bridge, veth ends)
  { ip -o link show 2>/dev/null || true; } | awk -F': ' '{print $2}' | sed 's/@.*//' |
    grep -E "^${TAG}(b|h[0-9]+)\$" || true
}

ns_inodes() {  # the inodes of the node namespaces: recorded at start, and those visible now
  local ns
  [ -f "$STATE/netns" ] && awk '{print $2}' "$STATE/netns"
  for ns in $(node_netns); do stat -L -c %i "/run/netns/$ns" 2>/dev/null || true; done
}

ns_processes() {  # pids of every process whose network namespace is one of the nodes'
  local inodes pid link
  inodes=" $(ns_inodes | sort -u | tr '\n' ' ')"
  [ "$inodes" != " " ] || return 0
  for pid in /proc/[0-9]*; do
    link=$(readlink "$pid/ns/net" 2>/dev/null) || continue   # net:[4026532345]
    link=${link#net:[}
    case "$inodes" in *" ${link%]} "*) echo "${pid#/proc/}" ;; esac
  done
}

# --- stop ------------------------------------------------------------------------------------

kill_node_processes() {
  local pids i
  pids=$(ns_processes | grep -vx "$$" || true)
  [ -n "$pids" ] || return 0
  kill -TERM $pids 2>/dev/null || true
  for i in $(seq 1 20); do
    pids=$(ns_processes | grep -vx "$$" || true)
    [ -n "$pids" ] || return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
  for i in $(seq 1 20); do
    [ -n "$(ns_processes | grep -vx "$$" || true)" ] || return 0
    sleep 0.1
  done
  say "warning: processes still in the nodes after SIGKILL: $(ns_processes | tr '\n' ' ')" >&2
}

cmd_stop() {
  local ns link left
  kill_node_processes
  for ns in $(node_netns); do ip netns delete "$ns" 2>/dev/null || true; done
  # a veth end deleted takes its peer (and both qdiscs) with it
  for link in $(our_links); do ip link delete "$link" 2>/dev/null || true; done
  rm -rf "$STATE"
  rmdir "$STATE_ROOT" 2>/dev/null || true
  left="$(node_netns | tr '\n' ' ')$(our_links | tr '\n' ' ')"
  [ -z "${left// /}" ] || die "stop: still there: $left"
}

# --- start -----------------------------------------------------------------------------------

subnet_in_use() {  # an address or route of SUBNET.0/24 outside this cluster
  ip -4 -o addr show 2>/dev/null | awk -v s="$SUBNET." '{split($4, a, "/"); if (index(a[1], s) == 1) print $2}' |
    { grep -v -x "$BRIDGE" || true; } | head -n 1
}

write_launcher() {
  cat >"$STATE/launcher" <<EOF
#!/usr/bin/env bash
# Generated by scripts/cluster.sh for the cluster $NAME: an ssh replacement for MPI launchers
# (hydra's -launcher-exec, Open MPI's plm_rsh_agent). "launcher [ssh options] HOST COMMAND..."
# runs COMMAND (one shell string, as ssh joins it) in HOST's network namespace, in a UTS
# namespace of its own whose hostname is the node's name. HOST: a node's name or address.
set -euo pipefail
while [ \$# -gt 0 ]; do
  case \$1 in
    --) shift; break ;;
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;   # an ssh option and its value
    -*) shift ;;                           # a flag, or an option with its value attached
    *) break ;;
  esac
done
[ \$# -ge 2 ] || { echo "$NAME launcher: expected HOST COMMAND..., got: \$*" >&2; exit 255; }
host=\${1#*@}; shift
node=\$(awk -v h="\$host" '\$1 == h || \$2 == h {print \$1; exit}' "$STATE/nodes")
[ -n "\$node" ] || { echo "$NAME launcher: no node \$host in $STATE/nodes" >&2; exit 255; }
exec ip netns exec "\$node" unshare --uts -- bash -c 'hostname "\$1" && eval "\$2"' \\
  "$NAME-launcher" "\$node" "\$*"
EOF
  chmod 755 "$STATE/launcher"
}

shape() {  # shape [ip -n NS] DEV: tbf on DEV's egress
  local dev=${*: -1}
  local where=("${@:1:$#-1}")
  [ "$RATE" = none ] && return 0
  tc "${where[@]}" qdisc replace dev "$dev" root tbf rate "$RATE" burst "$BURST" latency 50ms
}

STARTING=0
on_exit() {  # a start that did not finish leaves nothing behind
  local rc=$?
  if [ "$STARTING" = 1 ]; then
    STARTING=0
    cmd_stop >/dev/null 2>&1 || true
    echo "$PROG: error: start failed (exit $rc); what it made is removed" >&2
    exit 1
  fi
}

cmd_start() {
  local nodes=${1:-} i ns addr host
  shift || true
  [[ $nodes =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 200 ] ||
    die "NODES: expected a number of nodes from 1 to 200, got '$nodes'" 2
  RATE=1gbit BURST=256kb SUBNET=${MPIFUSION_CLUSTER_SUBNET:-10.213.7}
  while [ $# -gt 0 ]; do
    case $1 in
      --rate) RATE=${2:?--rate needs a value}; shift 2 ;;
      --burst) BURST=${2:?--burst needs a value}; shift 2 ;;
      --subnet) SUBNET=${2:?--subnet needs a value}; shift 2 ;;
      *) die "start: unknown option '$1'" 2 ;;
    esac
  done
  [[ $SUBNET =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] &&
    [ "${BASH_REMATCH[1]}" -le 255 ] && [ "${BASH_REMATCH[2]}" -le 255 ] &&
    [ "${BASH_REMATCH[3]}" -le 255 ] || die "--subnet: expected three octets (10.213.7), got '$SUBNET'" 2
  [[ $RATE =~ ^(none|[0-9]+(\.[0-9]+)?([kmgt]?(bit|bps))?)$ ]] ||
    die "--rate: expected a tc rate (100mbit, 1gbit) or none, got '$RATE'" 2
  need_tools
  ip netns list >/dev/null 2>&1 || die "ip netns does not work here" 3
  if [ -d "$STATE" ] || [ -n "$(node_netns)$(our_links)" ]; then
    say "stopping the cluster $NAME that exists"
    cmd_stop >/dev/null
  fi
  local used
  used=$(subnet_in_use)
  [ -z "$used" ] || die "--subnet $SUBNET: $SUBNET.0/24 is in use here (on $used): choose another"

  STARTING=1
  trap on_exit EXIT
  trap 'exit 130' INT TERM
  mkdir -p "$STATE"
  : >"$STATE/nodes"
  : >"$STATE/netns"
  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for ((i = 0; i < nodes; i++)); do
    ns=$NAME-n$i addr=$SUBNET.$((i + 2)) host=${TAG}h$i
    ip netns add "$ns"
    echo "$ns $(stat -L -c %i "/run/netns/$ns")" >>"$STATE/netns"
    ip -n "$ns" link set lo up
    ip link add "$host" type veth peer name eth0 netns "$ns"
    ip link set "$host" master "$BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    shape "$host"
    shape -n "$ns" eth0
    echo "$ns $addr $host" >>"$STATE/nodes"
  done
  printf 'NAME=%s\nNODES=%s\nSUBNET=%s\nBRIDGE=%s\nBRIDGE_ADDR=%s\nRATE=%s\nBURST=%s\n' \
    "$NAME" "$nodes" "$SUBNET" "$BRIDGE" "$SUBNET.1" "$RATE" "$BURST" >"$STATE/env"
  write_launcher
  # every node reaches the bridge over its link: a TCP connection to a closed port is
  # refused at once when it does, times out when it does not
  local out
  for ((i = 0; i < nodes; i++)); do
    out=$(ip netns exec "$NAME-n$i" timeout 5 bash -c "exec 3<>/dev/tcp/$SUBNET.1/9" 2>&1) ||
      case $out in
        *refused*) ;;
        *) echo "$PROG: error: node $NAME-n$i does not reach $SUBNET.1: ${out:-timed out}" >&2
           exit 1 ;;
      esac
  done
  STARTING=0
  trap - EXIT INT TERM
  say "running: $nodes node(s) $NAME-n0..$NAME-n$((nodes - 1)) on $SUBNET.0/24 (bridge $BRIDGE" \
    "$SUBNET.1), links shaped: $RATE; state in $STATE"
}

load_state() {
  [ -f "$STATE/env" ] && [ -f "$STATE/nodes" ] || die "no cluster $NAME (no $STATE/env)" 1
  # shellcheck disable=SC1091
  . "$STATE/env"
}

# --- mpiexec ---------------------------------------------------------------------------------

cmd_mpiexec() {
  local per=${1:-} mpi=mpich exe="" hosts="" node addr link
  shift || true
  [[ $per =~ ^[0-9]+$ ]] && [ "$per" -ge 1 ] ||
    die "RANKS_PER_NODE: expected a number >= 1, got '$per'" 2
  while [ $# -gt 0 ]; do
    case $1 in
      --mpi) mpi=${2:?--mpi needs mpich, openmpi or impi}; shift 2 ;;
      --mpiexec) exe=${2:?--mpiexec needs a path}; shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  [ $# -gt 0 ] || die "mpiexec: no command (… -- CMD...)" 2
  load_state
  while read -r node addr link; do hosts+=${hosts:+,}$addr:$per; done <"$STATE/nodes"
  local total=$((NODES * per))
  case $mpi in
    mpich)
      [ -n "$exe" ] || exe=$REPO/.venv/bin/mpiexec
      [ -x "$exe" ] || exe=$(command -v mpiexec) || die "no mpiexec (--mpiexec PATH)" 3
      # -localhost: the proxies call back to the bridge's address (the machine's hostname
      # means nothing inside a node); UCX_TLS: only tcp crosses the links, UCX's shared
      # memory transports would reach the other namespaces' processes directly
      export UCX_TLS=tcp,self
      exec "$exe" -localhost "$BRIDGE_ADDR" -launcher ssh -launcher-exec "$STATE/launcher" \
        -hosts "$hosts" -n "$total" "$@" ;;
    openmpi)
      if [ -z "$exe" ]; then
        exe=${MPIFUSION_OPENMPI_VENV:-$REPO/.venv-ompi}/bin/mpiexec
      fi
      [ -x "$exe" ] || die "no Open MPI mpiexec at $exe (--mpiexec PATH or MPIFUSION_OPENMPI_VENV)" 3
      if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
      fi
      # PRRTE: the agent starts prted on each node, the daemons call back on the bridge's
      # subnet; ranks: ob1 over tcp between nodes, sm only among a node's own ranks, no UCX.
      # mpi_yield_when_idle: every node's ranks share this machine's cores, which Open MPI
      # cannot see (each node has its own slots), so its waiting ranks would spin through
      # whole time slices: a 4-rank 4 KiB Allreduce on 2 nodes x 2 took 8 ms, 0.11 ms
      # yielding (16 MiB: 2.06 s, 0.05 s). On one machine --oversubscribe does the same.
      exec "$exe" --host "$hosts" -n "$total" --map-by slot --bind-to none \
        --mca plm_rsh_agent "$STATE/launcher" --mca plm_rsh_no_tree_spawn 1 \
        --mca oob_tcp_if_include "$SUBNET.0/24" --mca mpi_yield_when_idle 1 \
        --mca pml ob1 --mca btl tcp,sm,self --mca btl_tcp_if_include "$SUBNET.0/24" \
        "$@" ;;
    impi)
      [ -n "$exe" ] || exe=${MPIFUSION_IMPI_VENV:-$REPO/.venv-impi}/bin/mpiexec
      [ -x "$exe" ] || die "no Intel MPI mpiexec at $exe (--mpiexec PATH or MPIFUSION_IMPI_VENV)" 3
      # Intel's hydra: its bootstrap proxies call back to the address of -iface (the
      # machine's hostname means nothing inside a node); libfabric's tcp provider between
      # nodes (it is what the wheel picks here too), shared memory only within a node;
      # I_MPI_WAIT_MODE: its ranks wait instead of spinning, as the nodes share this
      # machine's cores (spinning, a 4 KiB Allreduce on 2 nodes x 2 took 8 ms, 0.04 ms so)
      export FI_PROVIDER=${FI_PROVIDER:-tcp} I_MPI_WAIT_MODE=${I_MPI_WAIT_MODE:-1}
      exec "$exe" -iface "$BRIDGE" -launcher ssh -launcher-exec "$STATE/launcher" \
        -hosts "$(cut -d' ' -f2 "$STATE/nodes" | paste -sd,)" -ppn "$per" -n "$total" "$@" ;;
    *) die "--mpi: expected mpich, openmpi or impi, got '$mpi'" 2 ;;
  esac
}

# --- status, bytes ---------------------------------------------------------------------------

cmd_bytes() {
  local node addr link
  load_state
  while read -r node addr link; do
    echo "$node $(cat "/sys/class/net/$link/statistics/rx_bytes" 2>/dev/null || echo -1)" \
      "$(cat "/sys/class/net/$link/statistics/tx_bytes" 2>/dev/null || echo -1)"
  done <"$STATE/nodes"
}

cmd_status() {
  local node addr link ok=0 qdisc procs
  if [ ! -f "$STATE/env" ]; then
    say "not running (no $STATE)"
    local left
    left="$(node_netns | tr '\n' ' ')$(our_links | tr '\n' ' ')"
    [ -z "${left// /}" ] || say "leftovers (scripts/cluster.sh stop $NAME removes them): $left"
    return 1
  fi
  . "$STATE/env"
  say "cluster $NAME: $NODES node(s) on $SUBNET.0/24, bridge $BRIDGE ($BRIDGE_ADDR), rate $RATE"
  ip link show "$BRIDGE" >/dev/null 2>&1 || { say "bridge $BRIDGE: missing"; ok=1; }
  while read -r node addr link; do
    if ! [ -e "/run/netns/$node" ]; then
      say "$node $addr: namespace missing (made in another mount namespace?)"; ok=1; continue
    fi
    ip link show "$link" >/dev/null 2>&1 || { say "$node: link $link missing"; ok=1; }
    qdisc=$(tc qdisc show dev "$link" 2>/dev/null | awk '/tbf/ {print $2, $7, $8; exit}')
    procs=$(ip netns pids "$node" 2>/dev/null | wc -l)
    say "$node $addr link $link ${qdisc:-unshaped} processes $procs"
  done <"$STATE/nodes"
  return "$ok"
}

cmd=${1:-}
[ $# -ge 2 ] || usage
check_name "$2"
names "$2"
shift 2
case $cmd in
  start) cmd_start "$@" ;;
  mpiexec) cmd_mpiexec "$@" ;;
  stop) [ $# = 0 ] || usage; need_tools; cmd_stop; say "stopped: $NAME" ;;
  status) [ $# = 0 ] || usage; cmd_status ;;
  bytes) [ $# = 0 ] || usage; cmd_bytes ;;
  *) usage ;;
esac
