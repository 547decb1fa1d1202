#!/usr/bin/env bash
# Everything a lent GPU machine is wanted for, in one call of the device tool (15 minutes of device
# time a session, start included, at most 10 a command): the GPU checks (benchmarks/gpu_checks.sh)
# on cores 8-15 and, at the same time, the netbench sections that need cores to spare
# (benchmarks/netbench_host.sh) on cores 0-7, two emulated nodes of 4 cores each. The two share
# no core; they do share the memory bus, which netbench's side-by-side ratios cancel but its
# absolute step times do not (say so when quoting them).
#
#     bash benchmarks/device_session.sh OUT_DIR [BUDGET_S] [SECTION...]      (as root)
#
# SECTION as netbench_host.sh takes them (NAME or NAME@RATE); default: hierarchy@1gbit
# two_phase@1gbit delay, in that order. A section starts only if its time limit (40 s per netbench
# run) fits in what is left of BUDGET_S (default 540 s), so the command ends inside the device
# tool's limit; skipped sections are named. One call fits about 13 runs: one whole section, or two
# one-link ones.
# OUT_DIR gets at most 8 files, as the device tool returns them: gpu.txt and netbench.txt (what
# each printed), each section's table (<section>-table.md), and session.tar.gz with every log,
# result and records file. Exit status: the GPU checks' failures plus the sections'.
#
# From this checkout, after `bash benchmarks/prepare_device.sh` (here, no device time) has put the
# wheels of the packages the machine lacks in .whl/ and ip/tc in .netbin/:
#     run(carry=[".whl", ".netbin"], timeout_s=600, command="python3 -m pip install -q --no-index
#         --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
#         export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.netbin:$PATH || exit; bash
#         benchmarks/device_session.sh $OUT")
set -u
OUT=${1:?usage: bash benchmarks/device_session.sh OUT_DIR [BUDGET_S] [SECTION...]}
BUDGET=${2:-540}
shift $(($# < 2 ? $# : 2))
SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(hierarchy@1gbit two_phase@1gbit delay)
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
mkdir -p "$OUT" "$scratch/gpu" "$scratch/netbench"
started=$SECONDS

if [ "$(nproc)" -lt 16 ]; then
    echo "device_session.sh needs 16 cores (8 for the GPU checks, 2 x 4 for netbench's nodes); this host has $(nproc)"
    exit 1
fi

taskset -c 8-15 bash "$here/gpu_checks.sh" "$scratch/gpu" >"$OUT/gpu.txt" 2>&1 &
gpu=$!

# netbench_host.sh skips a section whose limit would pass this deadline
NETBENCH_DEADLINE=$(($(date +%s) + BUDGET)) bash "$here/netbench_host.sh" "$scratch/netbench" 4 "${SECTIONS[@]}" \
    >"$OUT/netbench.txt" 2>&1
sections_failed=$?
wait "$gpu"
gpu_failed=$?

cp "$scratch"/netbench/*-table.md "$OUT/" 2>/dev/null
tar -czf "$OUT/session.tar.gz" -C "$scratch" gpu netbench
echo "=== GPU checks (cores 8-15): $gpu_failed failed"
tail -n 60 "$OUT/gpu.txt"
echo "=== netbench (cores 0-7): $sections_failed failed"
tail -n 90 "$OUT/netbench.txt"
echo "=== device_session.sh: $((SECONDS - started)) s"
rm -rf "$scratch"
exit $((gpu_failed + sections_failed))
