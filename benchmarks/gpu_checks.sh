#!/usr/bin/env bash
# The GPU checks, in one short run: the compiled Triton kernel tests (with those on tensors past
# 2**31 elements), the kernel benchmark with its Triton column, and a 1-GPU Trainer run of the
# quick start with dgc_ddp (DGC, then dense DDP).
#
#     bash benchmarks/gpu_checks.sh LOG_DIR
#
# Each step has its own time limit and a failing step does not stop the next; the logs (and the
# quick start's result.json) land flat in LOG_DIR. Exit status: the number of steps that failed.
set -u
LOG=${1:?usage: bash benchmarks/gpu_checks.sh LOG_DIR}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
failed=0

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, log to LOG/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "=== $name: $*"
    local started=$SECONDS
    timeout "$seconds" "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$LOG/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{ nvidia-smi -L; "$PY" -c "import torch, lightning, triton; print('torch', torch.__version__, '| lightning', lightning.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"; } 2>&1 | tee "$LOG/env.log"

step kernel_tests 200 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_huge.py
step kernel_bench 120 env TRITON_INTERPRET=0 "$PY" benchmarks/kernels.py --repeats 5
step quickstart 200 "$PY" train.py trainer.accelerator=gpu trainer.devices=1 hydra.run.dir=/tmp/gpu-quickstart
cp /tmp/gpu-quickstart/result.json "$LOG/quickstart-result.json" 2>/dev/null
echo "=== steps failed: $failed"
exit "$failed"
