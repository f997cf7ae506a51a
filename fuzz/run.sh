#!/usr/bin/env bash
# Run every fuzz target in this directory for N seconds each (default 20).
#
#   fuzz/run.sh [SECONDS] [extra libFuzzer flags...]
#
# Targets (the [[bin]]s of fuzz/Cargo.toml): packet, capsule, cm, cm_seq (the CM state
# machines fed sequences of real MADs, dropped, duplicated, replayed or altered), nbd (NBD
# handshake + request decoder).
#
# Built with plain cargo and the coverage flags cargo-fuzz would pass, so a fresh machine
# needs no `cargo install cargo-fuzz` (minutes of compiling on 2 cores). AddressSanitizer is
# left out: the parsers are safe Rust, and a panic is what libFuzzer catches here. With
# cargo-fuzz installed, `cargo fuzz run <target>` works as well. Exits non-zero if any
# target crashes (the reproducer is left in fuzz/artifacts/<target>/).
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

triple=$(rustc -vV | sed -n 's/^host: //p')
# What cargo-fuzz passes (sanitizer coverage for libFuzzer, `cfg(fuzzing)`, checks on);
# --target keeps the flags off build scripts and proc macros.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --release --target "$triple" --bins
targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^nvmf-rdma-fuzz$')
if [ -z "$targets" ]; then
    echo "no fuzz targets found" >&2
    exit 1
fi

failed=()
for t in $targets; do
    echo "=== fuzzing $t for ${secs}s ===" >&2
    mkdir -p "corpus/$t" "artifacts/$t"
    if ! "target/$triple/release/$t" -max_total_time="$secs" -artifact_prefix="artifacts/$t/" \
        "$@" "corpus/$t"; then
        echo "=== $t FAILED; reproducers in $(pwd)/artifacts/$t/ ===" >&2
        failed+=("$t")
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "fuzz targets that failed: ${failed[*]}" >&2
    exit 1
fi
echo "all fuzz targets ran ${secs}s without a crash" >&2
