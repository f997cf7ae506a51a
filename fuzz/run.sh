#!/usr/bin/env bash
# Run every cargo-fuzz target in this directory for N seconds each (default 20).
#
#   fuzz/run.sh [SECONDS] [extra libFuzzer flags...]
#
# Targets (from `cargo fuzz list`): packet, capsule, cm, nbd (NBD handshake + request decoder).
#
# Works with a stable toolchain: cargo-fuzz passes nightly-only flags (-Zsanitizer=...) to
# rustc, so RUSTC_BOOTSTRAP=1 is set for the build. Exits non-zero if any target crashes
# (the reproducer is left in fuzz/artifacts/<target>/).
set -euo pipefail

secs="${1:-20}"
if [ "$#" -gt 0 ]; then shift; fi
case "$secs" in
'' | *[!0-9]*)
    echo "usage: $0 [SECONDS] [libFuzzer flags...]" >&2
    exit 2
    ;;
esac

cd "$(dirname "$0")"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz not found; installing it" >&2
    cargo install --locked cargo-fuzz
fi

export RUSTC_BOOTSTRAP=1

targets=$(cargo fuzz list)
if [ -z "$targets" ]; then
    echo "no fuzz targets found" >&2
    exit 1
fi

failed=()
for t in $targets; do
    echo "=== fuzzing $t for ${secs}s ===" >&2
    if ! cargo fuzz run "$t" -- -max_total_time="$secs" "$@"; then
        echo "=== $t FAILED; reproducers in $(pwd)/artifacts/$t/ ===" >&2
        failed+=("$t")
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "fuzz targets that failed: ${failed[*]}" >&2
    exit 1
fi
echo "all fuzz targets ran ${secs}s without a crash" >&2
