#!/usr/bin/env bash
# Build the guest's initramfs ($VM/initramfs.cpio): busybox for the basics, real bash, ip,
# rdma, nvme-cli, fio and tcpdump with their shared libraries, libibverbs + librdmacm + the
# rxe provider, and the guest kernel's modules for rdma_rxe, rdma_ucm, nvmet-rdma, nvme-rdma
# and brd (plus what they depend on, plus every crypto module: rxe asks for its crc32 hash by
# name at device creation).
# Needs install-deps.sh first. Rebuilds only when this script or guest/ changed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VM=${VM:-/tmp/nvmf-vm}
KVER=$(cat "$VM/KVER")
KPKG=$VM/kpkg
ROOT=$VM/rootfs
OUT=$VM/initramfs.cpio
stamp=$(cat "$0" "$HERE"/guest/* | md5sum | cut -d' ' -f1)-$KVER
if [ -s "$OUT" ] && [ "$(cat "$VM/initramfs.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "initramfs up to date ($OUT)"; exit 0
fi
rm -rf "$ROOT"
mkdir -p "$ROOT"/{bin,sbin,usr/bin,usr/sbin,lib64,etc,proc,sys,dev,tmp,run,root,mnt/scripts,mnt/out,var/run,etc/nvme}

cp /bin/busybox "$ROOT/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$ROOT/bin/$a" ] || ln -s busybox "$ROOT/bin/$a"; done

add_file() {  # the file (symlinks followed) at the same path inside the image
  [ -e "$ROOT$1" ] && return 0
  mkdir -p "$ROOT$(dirname "$1")"; cp -L "$1" "$ROOT$1"
}
add_bin() {   # a host binary and the libraries ldd says it needs; /usr/bin or /usr/sbin in the image
  local p; p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$1") || { echo "missing on host: $1" >&2; exit 1; }
  p=$(readlink -f "$p")
  local dst=$p; case $dst in /bin/*|/sbin/*) dst=/usr$dst;; esac
  mkdir -p "$ROOT$(dirname "$dst")"; cp -L "$p" "$ROOT$dst"
  ldd "$p" | awk '/=> \//{print $3} /^\t\/lib/{print $1}' | while read -r l; do add_file "$l"; done
}
for b in bash ip rdma nvme fio tcpdump kmod ibv_devices ibv_devinfo; do add_bin "$b"; done
add_file /lib64/ld-linux-x86-64.so.2
for m in modprobe insmod rmmod lsmod modinfo depmod; do ln -sf /usr/bin/kmod "$ROOT/sbin/$m"; done
add_lib() {   # a host library (by soname) and what ldd says it needs
  local p=/usr/lib/x86_64-linux-gnu/$1
  [ -e "$p" ] || { echo "missing on host: $p" >&2; exit 1; }
  add_file "$p"
  ldd "$p" | awk '/=> \//{print $3}' | while read -r l; do add_file "$l"; done
}
# rdma-core at run time: the rxe user-space provider (libibverbs dlopens it), and libibverbs +
# librdmacm, which `nvmf-rdma hw` (the `hw` case) dlopens by soname
mkdir -p "$ROOT/etc/libibverbs.d"; cp /etc/libibverbs.d/rxe.driver "$ROOT/etc/libibverbs.d/"
for so in /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so; do add_file "$so"; done
add_lib libibverbs.so.1; add_lib librdmacm.so.1
printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n' > "$ROOT/etc/ld.so.conf"
ldconfig -r "$ROOT"

MODS="rdma_rxe ib_uverbs rdma_ucm nvme-rdma nvmet-rdma brd configfs virtio_pci virtio_net virtio_rng dummy macvlan
      9p 9pnet_virtio crc32_generic crc32c_generic crc32c-intel"
for m in $MODS; do
  modprobe -d "$KPKG" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | sort -u | while read -r ko; do
  rel=${ko#"$KPKG"}; mkdir -p "$ROOT$(dirname "$rel")"; cp "$ko" "$ROOT$rel"
done
for d in crypto arch/x86/crypto; do
  mkdir -p "$ROOT/lib/modules/$KVER/kernel/$d"
  cp -r "$KPKG/lib/modules/$KVER/kernel/$d/." "$ROOT/lib/modules/$KVER/kernel/$d/"
done
cp "$KPKG/lib/modules/$KVER"/modules.{builtin,builtin.modinfo,order} "$ROOT/lib/modules/$KVER/"
depmod -b "$ROOT" "$KVER"

echo "root:x:0:0:root:/root:/bin/sh" > "$ROOT/etc/passwd"
echo "root:x:0:" > "$ROOT/etc/group"
echo "127.0.0.1 localhost" > "$ROOT/etc/hosts"
cp "$HERE/guest/init" "$ROOT/init"; chmod +x "$ROOT/init"
mkdir -p "$ROOT/opt/guest"; cp "$HERE"/guest/*.sh "$ROOT/opt/guest/"
(cd "$ROOT" && find . -print0 | cpio --null -o -H newc --quiet) > "$OUT"
echo "$stamp" > "$VM/initramfs.stamp"
echo "initramfs: $OUT $(du -h "$OUT" | cut -f1), $(find "$ROOT/lib/modules" -name '*.ko' | wc -l) modules"
