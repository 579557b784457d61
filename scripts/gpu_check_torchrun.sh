#!/usr/bin/env bash
# torchrun on every GPU of this machine under oomguard, NCCL, a real CUDA OOM on rank 1 only.
# Expect: attempt 1 ends cuda_oom naming "rank 1 (local rank 1, GPU 1)"; attempt 2 runs every rank
# at half the micro-batch from the newest checkpoint; /metrics shows every GPU and every rank.
#     bash scripts/gpu_check_torchrun.sh        (exits 2 without at least two GPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${gpus:-0}" -lt 2 ]; then
    echo "gpu_check_torchrun: needs at least two GPUs (found ${gpus:-0})" >&2
    exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
micro=4
global=$((micro * 2 * gpus))
.venv/bin/python -m oomguard run --run-dir "$work/run" --no-web --backoff 0.1 \
    --nproc-per-node "$gpus" --micro-batch "$micro" --global-batch "$global" \
    --checkpoint "$work/ck/step-*" --resume-args '--resume-from {checkpoint}' \
    -- .venv/bin/python tests/workers/ddp_train.py --device cuda --fault cuda --fault-rank 1 \
    --micro-batch-size '{micro_batch}' --gradient-accumulation-steps '{grad_accum}' --ckpt-dir "$work/ck"
.venv/bin/python -m oomguard status --run-dir "$work/run"
.venv/bin/python -m oomguard report --run-dir "$work/run" | head -40
