#!/usr/bin/env bash
# Run COMMAND in a fresh network namespace whose loopback drops PERCENT% of UDP datagrams at
# random (nftables `numgen random`, on the output hook: every datagram between two local
# sockets passes it once, so each direction loses PERCENT%). Needs root (ip netns, nft).
# usage: bash fio-plugin/loss.sh PERCENT -- COMMAND [ARGS...]
#   e.g. bash fio-plugin/loss.sh 5 -- target/release/nvmf-rdma bench --seconds 5 --job randread-4k-qd32
# PERCENT is a whole number 0..100 (0: the same namespace with no rule, for a baseline).
set -euo pipefail
pct=${1:?usage: loss.sh PERCENT -- COMMAND [ARGS...]}
shift
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "loss.sh: no command given; usage: loss.sh PERCENT -- COMMAND [ARGS...]" >&2; exit 2; }
case $pct in
  '' | *[!0-9]*) echo "loss.sh: PERCENT must be a whole number 0..100, got '$pct'" >&2; exit 2 ;;
esac
[ "$pct" -le 100 ] || { echo "loss.sh: PERCENT must be at most 100, got $pct" >&2; exit 2; }
ns=nvmf-loss-$$
ip netns add "$ns"
trap 'ip netns del "$ns"' EXIT
ip -n "$ns" link set lo up
if [ "$pct" -gt 0 ]; then
  ip netns exec "$ns" nft -f - <<NFT
table inet nvmf_loss {
  chain out {
    type filter hook output priority 0; policy accept;
    meta l4proto udp numgen random mod 100 < $pct counter drop
  }
}
NFT
fi
ip netns exec "$ns" "$@"
