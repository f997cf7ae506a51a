#!/usr/bin/env bash
# Prepare a Debian machine for the fio plugin, idempotently (run as root):
#   1. enable deb-src for the running suite (needed by `apt-get source`),
#   2. install fio (and nbdkit, nftables and iproute2, for bench.sh and its loss runs),
#   3. fetch the source of exactly the installed fio version and run its configure, which
#      writes config-host.h (the plugin compiles against fio's own headers),
#   4. build the plugin in release.
# Prints where the fio source and the plugin are; `eval "$(fio-plugin/setup.sh --env)"` after
# a first run exports FIO_SRC (what `cargo build/test -p nvmf-rdma-fio` need) and does nothing else.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
src_root=${FIO_SRC_ROOT:-$here/fio-src}

fio_src_dir() { ls -d "$src_root"/fio-*/ 2>/dev/null | head -n 1 | sed 's:/$::'; }

if [ "${1:-}" = "--env" ]; then
  echo "export FIO_SRC=$(fio_src_dir)"
  exit 0
fi

apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@"; }

need_update=0
if ! grep -rqsE '^(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  . /etc/os-release
  cat >/etc/apt/sources.list.d/nvmf-rdma-deb-src.sources <<SRC
# Added by nvmf-rdma fio-plugin/setup.sh: source packages for \`apt-get source fio\`.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: ${VERSION_CODENAME} ${VERSION_CODENAME}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  need_update=1
fi
pkgs=""
for p in fio nbdkit nftables iproute2 dpkg-dev gcc make; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || pkgs="$pkgs $p"
done
if [ -n "$pkgs" ] || [ "$need_update" = 1 ] || [ -z "$(fio_src_dir)" ]; then
  apt_get update -qq
fi
if [ -n "$pkgs" ]; then
  # shellcheck disable=SC2086
  apt_get install -y -qq --no-install-recommends $pkgs >/dev/null
fi

# The source of the installed version, not whatever the index has newest: the headers must
# describe the structures of the fio binary that will load the plugin.
version=$(dpkg-query -W -f='${Version}' fio)
stamp="$src_root/.version"
if [ "$(cat "$stamp" 2>/dev/null)" != "$version" ] || [ -z "$(fio_src_dir)" ]; then
  rm -rf "$src_root"
  mkdir -p "$src_root"
  # The download sandbox user cannot write into a checkout owned by root.
  (cd "$src_root" && apt_get -o APT::Sandbox::User=root source -qq "fio=$version" >/dev/null)
  echo "$version" >"$stamp"
fi
fio_src=$(fio_src_dir)
if [ ! -f "$fio_src/config-host.h" ]; then
  (cd "$fio_src" && ./configure --disable-native --prefix=/usr >/dev/null)
fi

cd "$root"
FIO_SRC=$fio_src cargo build --release -p nvmf-rdma-fio
so=$root/target/release/libnvmf_rdma_fio.so
echo "fio $(fio --version) source: $fio_src"
echo "plugin: $so"
echo "export FIO_SRC=$fio_src"
echo "export NVMF_FIO_PLUGIN=$so"
