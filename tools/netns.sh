#!/usr/bin/env bash
# Simulated hosts on one machine: network namespaces joined by a bridge, for trying multi-host jobs.
#
#   tools/netns.sh up N [PREFIX]    hosts PREFIX1..PREFIXN (default PREFIX: ns) on a private /24
#   tools/netns.sh down [PREFIX]    remove everything `up` made (idempotent, also after a partial up)
#   tools/netns.sh status [PREFIX]  what is up, with addresses
#
# Each host is a namespace with its own loopback and one interface (eth0, address SUBNET.i) on a
# bridge. The bridge lives in a namespace of its own (PREFIXsw), so the machine's firewall (Docker's
# FORWARD DROP, say) never sees the traffic; the machine itself is SUBNET.254 on it (interface
# PREFIX-sw). Names resolve everywhere: `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over
# /etc/hosts, and a marked block in /etc/hosts serves this namespace. The subnet is 10.X.Y.0/24,
# X.Y derived from PREFIX; set NETNS_SUBNET=10.77.3 to choose it. Needs root and iproute2.
#
# A veth pair moves bytes as fast as the kernel copies them, so the "wire" costs CPU time and
# nothing else. NETNS_RATE=10gbit (tc's rate syntax) gives each host a link of that rate instead,
# each way (a token bucket on both ends of its veth pair), as a real NIC has: then the link is
# a resource of its own, and what a job does with the CPU while its bytes cross shows.
#
# Try a two-host job:  tools/netns.sh up 2 && printf 'ns1 slots=2\nns2 slots=2\n' > hosts &&
#   shmcoll-run --hostfile hosts --rsh "ip netns exec" train.py; tools/netns.sh down
set -eEuo pipefail  # -E: the ERR trap that undoes a failed `up` fires inside functions too

STATE_DIR=/run/shmcoll-netns
MARK=shmcoll-netns

die() { echo "netns.sh: $*" >&2; exit 1; }

usage() { sed -n '4,6s/^# //p' "$0" >&2; exit 2; }

check_prefix() {
  [[ $1 =~ ^[a-z][a-z0-9]{0,9}$ ]] || die "PREFIX must be 1-10 of [a-z0-9], starting with a letter: '$1'"
}

need_root() {
  [[ $(id -u) == 0 ]] || die "needs root (namespaces, links and /etc/hosts)"
  command -v ip >/dev/null || die "needs iproute2 (the 'ip' command): apt-get install iproute2"
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/.lock"
  flock -w 30 9 || die "another netns.sh holds $STATE_DIR/.lock"
}

subnet_for() {  # 10.X.Y from the prefix, unless NETNS_SUBNET says
  if [[ -n ${NETNS_SUBNET:-} ]]; then
    [[ $NETNS_SUBNET =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] &&
      ((BASH_REMATCH[1] < 256 && BASH_REMATCH[2] < 256 && BASH_REMATCH[3] < 256)) ||
      die "NETNS_SUBNET is three octets, like 10.77.3; got '$NETNS_SUBNET'"
    echo "$NETNS_SUBNET"; return
  fi
  local h; h=$(printf '%s' "$1" | cksum | cut -d' ' -f1)
  echo "10.$((200 + h % 50)).$((h / 50 % 256))"
}

ns_exists() { ip netns list | awk '{print $1}' | grep -qx -- "$1"; }

hosts_lines() {  # SUBNET N PREFIX: one "address name" line per host
  local i; for ((i = 1; i <= $2; i++)); do echo "$1.$i $3$i"; done
}

drop_hosts_block() {  # in place: /etc/hosts is often a bind mount that cannot be replaced
  local tmp; tmp=$(mktemp)
  awk -v b="# BEGIN $MARK $1" -v e="# END $MARK $1" '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' \
    /etc/hosts >"$tmp"
  cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

add_host() {  # PREFIX I SUBNET N: namespace PREFIXi, its hosts file, its port on the bridge
  local ns=$1$2 sw=$1sw
  mkdir -p "/etc/netns/$ns"
  { echo "# $MARK $1"; echo "127.0.0.1 localhost"; echo "::1 localhost ip6-localhost ip6-loopback"
    hosts_lines "$3" "$4" "$1"; } >"/etc/netns/$ns/hosts"
  ip netns add "$ns"
  ip -n "$sw" link add "h$2" type veth peer name eth0 netns "$ns"
  ip -n "$sw" link set "h$2" master br0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$3.$2/24" dev eth0
  ip -n "$ns" link set eth0 up
  if [[ -n ${NETNS_RATE:-} ]]; then
    tc -n "$ns" qdisc add dev eth0 root tbf rate "$NETNS_RATE" burst 256kb latency 20ms
    tc -n "$sw" qdisc add dev "h$2" root tbf rate "$NETNS_RATE" burst 256kb latency 20ms
  fi
}

cmd_up() {
  local n=${1:-} prefix=${2:-ns}
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 200)) || die "up needs a host count 1..200, got '$n'"
  check_prefix "$prefix"
  need_root
  local subnet i; subnet=$(subnet_for "$prefix")
  [[ ! -e $STATE_DIR/$prefix ]] || die "'$prefix' is already up; run: $0 down $prefix"
  for ((i = 1; i <= n; i++)); do ! ns_exists "$prefix$i" || die "namespace $prefix$i already exists"; done
  ! ns_exists "${prefix}sw" || die "namespace ${prefix}sw already exists"
  ! ip link show "$prefix-sw" >/dev/null 2>&1 || die "interface $prefix-sw already exists"
  [[ -z $(ip route show to "$subnet.0/24") ]] || die "$subnet.0/24 is in use here; set NETNS_SUBNET"
  if [[ -n ${NETNS_RATE:-} ]]; then
    [[ $NETNS_RATE =~ ^[0-9]+(\.[0-9]+)?[kmgt]?bit$ ]] || die "NETNS_RATE is a rate like 10gbit or 500mbit; got '$NETNS_RATE'"
    command -v tc >/dev/null || die "NETNS_RATE needs tc (iproute2)"
  fi
  echo "$n $subnet" >"$STATE_DIR/$prefix"  # first: from here on, `down` knows what to remove
  trap 'echo "netns.sh: up failed; undoing" >&2; teardown "$prefix"' ERR
  ip netns add "${prefix}sw"
  ip -n "${prefix}sw" link add br0 type bridge
  ip -n "${prefix}sw" link set br0 up
  for ((i = 1; i <= n; i++)); do add_host "$prefix" "$i" "$subnet" "$n"; done
  ip link add "$prefix-sw" type veth peer name root netns "${prefix}sw"
  ip -n "${prefix}sw" link set root master br0 up
  ip addr add "$subnet.254/24" dev "$prefix-sw"
  ip link set "$prefix-sw" up
  { echo "# BEGIN $MARK $prefix"; hosts_lines "$subnet" "$n" "$prefix"; echo "# END $MARK $prefix"; } >>/etc/hosts
  trap - ERR
  echo "netns.sh: up: hosts ${prefix}1..$prefix$n on $subnet.0/24 (this machine: $subnet.254)${NETNS_RATE:+, links of $NETNS_RATE}"
}

teardown() {  # PREFIX: everything up may have made, in any state; never fails
  local prefix=$1 ns
  ip link del "$prefix-sw" 2>/dev/null || true  # takes its peer in the bridge namespace with it
  for ns in $( (ip netns list | awk '{print $1}' | grep -x -- "$prefix[0-9]\+") || true); do
    ip -n "$ns" link del eth0 2>/dev/null || true  # now, not when the kernel gets to the namespace
    ip netns del "$ns" 2>/dev/null || true
  done
  ip netns del "${prefix}sw" 2>/dev/null || true
  for ns in /etc/netns/"$prefix"[0-9]*; do
    if [[ -f $ns/hosts ]] && head -n1 "$ns/hosts" | grep -qx "# $MARK $prefix"; then rm -rf "$ns"; fi
  done
  rmdir /etc/netns 2>/dev/null || true  # only when empty
  drop_hosts_block "$prefix"
  local deadline=$((SECONDS + 5))
  while ip link show "$prefix-sw" >/dev/null 2>&1 && ((SECONDS < deadline)); do sleep 0.1; done
  rm -f "$STATE_DIR/$prefix"
}

cmd_down() {
  local prefix=${1:-ns}
  check_prefix "$prefix"
  need_root
  teardown "$prefix"
  echo "netns.sh: down: $prefix"
}

cmd_status() {
  command -v ip >/dev/null || die "needs iproute2 (the 'ip' command)"
  local state prefix n subnet i ns
  for state in "$STATE_DIR"/*; do
    [[ -f $state ]] || continue
    prefix=${state##*/}
    [[ -z ${1:-} || $1 == "$prefix" ]] || continue
    read -r n subnet <"$state"
    echo "$prefix: $n hosts on $subnet.0/24"
    for ((i = 1; i <= n; i++)); do
      ns=$prefix$i
      if ns_exists "$ns"; then
        echo "  $ns $(ip -n "$ns" -4 -br addr show eth0 2>/dev/null | awk '{print $2, $3}')"
      else
        echo "  $ns missing"
      fi
    done
  done
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down "$@" ;;
  status) shift; cmd_status "$@" ;;
  *) usage ;;
esac
