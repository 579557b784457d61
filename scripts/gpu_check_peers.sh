#!/usr/bin/env bash
# Issue 29's GPU half in one command, sized for a lent GPU machine (one command at most 10 minutes):
# the probe's real CUDA tests, then the peers benchmark on CUDA (docs/peers-cuda.md), each stage under
# its own deadline so a slow one cannot take the next one's time, everything under $OUT.
#
# Here, once:  bash ../shared/device-kit/prepare.sh        (the machine has torch, transformers, accelerate)
# There:       . .device-kit/setup.sh && bash scripts/gpu_check_peers.sh      (carry .device-kit)
#
# The benchmark runs the contenders that keep the global batch, the measured re-run and the sweep, three
# rounds (the least the table accepts); the framework peers that drift the batch are left to a longer
# lease (`--only` lists them) because their imports alone take 10-14 s a process on such a machine.
# Exits 2 without a CUDA device, before anything else runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-$(mktemp -d)}
py=${PYTHON:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check_peers: no CUDA device visible to $py (torch.cuda.is_available() is False)" >&2
    exit 2
fi
{ nvidia-smi -L; "$py" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'; } \
    | tee "$out/machine.txt"
OOMGUARD_GPU_TESTS=1 timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/e2e/test_probe_gpu.py \
    2>&1 | tail -25 | tee "$out/probe-gpu.txt"
timeout "${PEERS_TIMEOUT:-390}" "$py" bench/peers.py --device cuda --rounds 3 --no-bisect --sweep-min 8 \
    --only oomguard-run oomguard-run-measured oomguard-run-predict oomguard-session \
           accelerate-find-executable-batch-size \
    --docs "$out/docs" --json "$out/peers-cuda.json" --work "$out/work" --timeout 90 \
    > "$out/peers.log" 2>&1
echo "peers: exit $? ($(tail -1 "$out/peers.log"))"
ls -R "$out/docs" 2>/dev/null
