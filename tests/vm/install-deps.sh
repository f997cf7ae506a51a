#!/usr/bin/env bash
# Host packages for the interop VM, and the Debian guest kernel (downloaded and unpacked
# under $VM, never installed on the host). Idempotent: a second run only checks.
set -euo pipefail
VM=${VM:-/tmp/nvmf-vm}
APT="apt-get -o DPkg::Lock::Timeout=600 -qq"
PKGS="qemu-system-x86 busybox-static kmod iproute2 rdma-core ibverbs-utils ibverbs-providers
      rdmacm-utils nvme-cli fio cpio tcpdump jq"
mkdir -p "$VM"
missing=""
for p in $PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  $APT update
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $APT install -y --no-install-recommends $missing >/dev/null
fi
if [ ! -s "$VM/vmlinuz" ] || [ ! -s "$VM/KVER" ] || [ ! -d "$VM/kpkg/lib/modules/$(cat "$VM/KVER")" ]; then
  # The kernel linux-image-amd64 points at (6.1.x on bookworm): it has rdma_rxe,
  # nvme-rdma, nvmet-rdma and brd as modules.
  KPKG=${KPKG_NAME:-$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')}
  [ -n "$KPKG" ] || { $APT update; KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}'); }
  cd "$VM"
  rm -rf kpkg linux-image-*.deb
  $APT download "$KPKG"
  dpkg-deb -x linux-image-*.deb kpkg
  KVER=$(ls kpkg/lib/modules)
  depmod -b kpkg "$KVER"
  cp "kpkg/boot/vmlinuz-$KVER" vmlinuz
  echo "$KVER" > KVER
  rm -f linux-image-*.deb
fi
echo "guest kernel $(cat "$VM/KVER"), $(dpkg-query -W -f='qemu ${Version}' qemu-system-x86)"
