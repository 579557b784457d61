#!/usr/bin/env bash
# The main job: a real training run under oomguard, dashboard on. Host memory is squeezed at step
# 25 (a real RLIMIT_AS, so PyTorch's CPU allocator really fails); the supervisor classifies the
# host OOM, halves the micro-batch, doubles accumulation (global batch stays 128) and resumes from
# the newest checkpoint. Open the printed dashboard URL while it runs; the report follows.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
RUN=${RUN_DIR:-runs/demo}
rm -rf "$RUN"
# The demo's own fit store, fresh each time: with the user's (~/.cache/oomguard), a second demo
# would start at the size the first one settled on and show no failure at all.
export OOMGUARD_CACHE_DIR="$RUN/fit-store"
status=0
.venv/bin/oomguard run --run-dir "$RUN" --port "${PORT:-8765}" --global-batch 128 --micro-batch 128 \
  --checkpoint "$RUN/ckpt/checkpoint-*" -- \
  .venv/bin/python examples/train_worker_demo.py --checkpoint-dir "$RUN/ckpt" --checkpoint-every 10 \
  --memory-budget-mb 400 --squeeze-at-step 25 --squeeze-budget-mb 20 --no-inprocess \
  --steps "${DEMO_STEPS:-1200}" || status=$?
echo
.venv/bin/oomguard report --run-dir "$RUN"
exit $status
