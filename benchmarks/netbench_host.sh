#!/usr/bin/env bash
# The netbench targets that one core per emulated node could not reach (delayed synchronisation,
# the two-phase exchange, the two-level hierarchy), run on a host with cores to spare: each node
# pinned to its own block of CORES cores (netbench --cores-per-node), training on the CPU.
#
#     bash benchmarks/netbench_host.sh OUT_DIR [CORES] [SECTION...]     (as root)
#
# SECTION: delay (gc_fp16 with delay=1 against torch's fp16 hook), two_phase (onebit, gather
# against two-phase at N = 2), hierarchy (2 nodes x 2 processes, flat against hierarchy="node" and "node_sparse");
# NAME@RATE runs one of its links only (e.g. two_phase@100mbit); default: all three, every link.
# Each section's records.jsonl and table land flat in OUT_DIR (NAME-records.jsonl, NAME_RATE-...); a
# section that fails does not stop the next. A section's time limit is RUN_S (default 40) seconds
# per netbench run (one mode, one repeat, one link: 27-35 s on the H200 machine's host, 2026-11-27)
# plus 30 s for its socket tests. With NETBENCH_DEADLINE (a `date +%s` time) set, a section whose
# limit would pass it is skipped and named. Exit status: the number of sections that failed.
#
# Where the host has no `ip`/`tc` (the GPU machines lent here have neither), put a folder with
# them on PATH: `bash benchmarks/prepare_device.sh`, on a Debian/Ubuntu host that has iproute2,
# builds .netbin/ (each binary with its libraries, wrapped to run through the host's loader).
set -u
OUT=${1:?usage: bash benchmarks/netbench_host.sh OUT_DIR [CORES] [SECTION...]}
CORES=${2:-4}
shift $(($# < 2 ? $# : 2))
SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(delay two_phase hierarchy)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
failed=0

RUN_S=${RUN_S:-40}

section() {  # section NAME REPEATS "RATE..." "MODE..." [NETBENCH-ARGS...]: one netbench run, records and table kept
    local name=${1/@/_} repeats=$2 rates=($3) modes=($4)
    shift 4
    local seconds=$((${#rates[@]} * ${#modes[@]} * repeats * RUN_S + 30))
    local left=$((${NETBENCH_DEADLINE:-0} - $(date +%s)))
    if [ -n "${NETBENCH_DEADLINE:-}" ] && [ "$left" -lt "$seconds" ]; then
        echo "=== $name: skipped (its limit is $seconds s, $left s left before the deadline)"
        return
    fi
    echo "=== $name: netbench --cores-per-node $CORES --rates ${rates[*]} --modes ${modes[*]} --repeats $repeats $* (limit $seconds s)"
    timeout "$seconds" "$PY" -m benchmarks.netbench --cores-per-node "$CORES" --models resnet18 \
        --steps 10 --warmup 3 --out "/tmp/netbench-$name" --rates "${rates[@]}" --modes "${modes[@]}" \
        --repeats "$repeats" "$@" 2>&1 | grep -v -i warning | tail -n 25
    local rc=${PIPESTATUS[0]}
    cp "/tmp/netbench-$name/records.jsonl" "$OUT/$name-records.jsonl" 2>/dev/null
    cp "/tmp/netbench-$name/table.md" "$OUT/$name-table.md" 2>/dev/null
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

for wanted in "${SECTIONS[@]}"; do
    name=${wanted%@*}
    rates=${wanted#*@}
    [ "$rates" != "$wanted" ] || rates=""
    case $name in
    delay) section "$wanted" 3 "${rates:-1gbit}" "noop torch_fp16 gc_fp16 gc_fp16_delay1" ;;
    two_phase) section "$wanted" 3 "${rates:-1gbit 100mbit}" "noop gc_onebit gc_onebit_2p" ;;
    hierarchy) section "$wanted" 2 "${rates:-1gbit 100mbit}" "noop gc_dgc gc_dgc_node gc_dgc_nodesparse" --devices-per-node 2 ;;
    *) echo "unknown section $wanted (delay, two_phase, hierarchy, each optionally @RATE)"; failed=$((failed + 1)) ;;
    esac
done
echo "=== sections failed: $failed"
exit "$failed"
