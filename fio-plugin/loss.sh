#!/usr/bin/env bash
# Run a command in a private network namespace whose loopback drops PERCENT % of UDP packets
# at random, so the soft-HCA (RoCEv2 is UDP) sees random loss and has to retransmit.
#
# usage: bash fio-plugin/loss.sh PERCENT -- COMMAND [ARG...]
#   PERCENT  whole number 0-100; 0 gives the same namespace with no loss (the baseline).
#   COMMAND  runs inside the namespace (as `ip netns exec`), with the caller's environment
#            and working directory; the script exits with its exit status.
# example: bash fio-plugin/loss.sh 5 -- fio fio-plugin/examples/builtin.fio
#          bash fio-plugin/loss.sh 2 -- bash -c 'nvmf-rdma target --ram 1G & sleep 1; fio job.fio'
#
# What it does: `ip netns add nvmf-loss-PID`, loopback up (the only interface: there is no
# route off the machine, so only 127.0.0.0/8 and ::1 exist inside), then one nftables rule
# on the input hook: `meta l4proto udp numgen random mod 100 < PERCENT drop`. Each UDP packet
# passes the input hook once on loopback, so each is dropped with probability PERCENT/100,
# both directions alike. (Dropping on the output hook instead would fail the sender's
# sendmsg with EPERM, which is not what a lossy wire does.) On exit, normal or not, the
# namespace is deleted (and its rules with it); the dropped-packet count goes to stderr.
# needs: root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2, nft.
set -euo pipefail
usage="usage: loss.sh PERCENT -- COMMAND [ARG...] (PERCENT a whole number 0-100)"
[ $# -ge 3 ] && [ "$2" = "--" ] || { echo "loss.sh: $usage" >&2; exit 2; }
pct=$1
shift 2
[[ $pct =~ ^[0-9]+$ ]] && [ "$pct" -le 100 ] || { echo "loss.sh: PERCENT '$pct' is not 0-100; $usage" >&2; exit 2; }
for tool in ip nft; do
  command -v "$tool" >/dev/null || { echo "loss.sh: $tool is missing (apt-get install iproute2 nftables)" >&2; exit 1; }
done

ns=nvmf-loss-$$
cleanup() {
  if ip netns list | grep -qw "$ns"; then
    dropped=$(ip netns exec "$ns" nft list table inet nvmf_loss 2>/dev/null |
              sed -n 's/.*counter packets \([0-9]*\) .*/\1/p')
    echo "loss.sh: $pct% loss: ${dropped:-?} UDP packets dropped" >&2
    ip netns del "$ns"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$ns" || { echo "loss.sh: cannot create a network namespace (run as root)" >&2; exit 1; }
ip -n "$ns" link set lo up
ip netns exec "$ns" nft -f - <<EOF
table inet nvmf_loss {
  chain input {
    type filter hook input priority 0; policy accept;
    meta l4proto udp numgen random mod 100 < $pct counter drop
  }
}
EOF
set +e
ip netns exec "$ns" "$@"
status=$?
set -e
exit "$status"
