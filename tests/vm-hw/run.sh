#!/bin/bash
# Boot a TCG guest with soft-RoCE (rxe) + the kernel NVMe-oF target and run
# guest/hw-bench.sh: our `hw` backend and the kernel nvme-rdma host side by side.
# Reuses the reference recipe (install-deps.sh, build-initramfs.sh, run-vm.sh, guest/init) and
# appends our release binary to its initramfs as a second cpio archive.
# Usage (root):  tests/vm-hw/run.sh            # EXTRA_APPEND="vmrt=5 vmcases=hw" to narrow
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
REF=${REF:-/work/shared/reference/vm-linux-rxe}
export VM=${VM:-/tmp/vm-hw}
W=${W:-/tmp/vm-hw-scripts}
rm -rf "$W"; mkdir -p "$W"; cp -r "$REF/." "$W/"; chmod -R u+w "$W"
cp "$REPO"/tests/vm-hw/guest/*.sh "$W/guest/"
# qemu through a symlink of another name: other jobs on a shared CI box may clean up
# "qemu-system-*" processes by name, which must not take this run down.
mkdir -p "$VM/bin"; ln -sf "$(command -v qemu-system-x86_64)" "$VM/bin/qemu-hw-x86_64"
sed -i 's|qemu-system-x86_64 \$ACCEL|"$VM/bin/qemu-hw-x86_64" $ACCEL|' "$W/run-vm.sh"
grep -q qemu-hw-x86_64 "$W/run-vm.sh"
[ -e "$VM/vmlinuz" ] || "$W/install-deps.sh"
(cd "$REPO" && cargo build --release --features hw --bin nvmf-rdma)
# the device tests (tests/hw_backend.rs) run in the guest too, against rxe
TESTBIN=$(cd "$REPO" && cargo test --release --features hw --test hw_backend --no-run 2>&1 |
  grep -o 'target/release/deps/hw_backend-[0-9a-f]*' | tail -1)
"$W/build-initramfs.sh"
# second archive: the stripped binary and the libraries it links (the kernel unpacks both)
X=$VM/extra; rm -rf "$X"; mkdir -p "$X/usr/bin"
strip -o "$X/usr/bin/nvmf-rdma" "$REPO/target/release/nvmf-rdma"
strip -o "$X/usr/bin/hw_backend" "$REPO/$TESTBIN"
ldd "$REPO/target/release/nvmf-rdma" | awk '/=> \//{print $3}' | while read -r l; do
  mkdir -p "$X$(dirname "$l")"; cp -L "$l" "$X$l"; done
(cd "$X" && find . -print0 | cpio --null -o -H newc --quiet) >> "$VM/initramfs.cpio"
ls -la "$VM/initramfs.cpio"
"$W/run-vm.sh" -s hw-bench.sh
echo "guest log: $VM/out/hw-bench.log"
grep -E 'HW-RESULT|KERNEL-RESULT|HW-VERIFY|rc=' "$VM/out/hw-bench.log" || true
