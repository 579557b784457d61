"""A worker that SIMULATES the in-process probe (oomguard/probe/): it appends to the channel
(``OOMGUARD_EVENTS``) exactly the ``probe``, ``step`` and ``oom`` records the probe writes, with
``common.protocol.encode``, and needs no torch and no GPU. Its figures come from a simple memory
model: each step's allocator peak is ``fixed + per_sample × micro-batch`` against a limit. Above
``--fail-above`` it reports the probe's ``oom`` record after a few steps and dies the way PyTorch does
on a CUDA OOM (the traceback's last line on stderr, exit 1). Its output also prints lines that look
like steps at ten times the real count: with the probe's records, they must not move the count.

The supervisor-side tests use it until the real probe is merged; the probe's own tests cover what it
writes from real optimizers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from oomguard.common import protocol

MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fail-above", type=int, default=0, help="a CUDA OOM at micro-batches above this")
    parser.add_argument("--fixed-mib", type=int, default=1024)
    parser.add_argument("--per-sample-mib", type=int, default=256)
    parser.add_argument("--total-mib", type=int, default=81920)
    parser.add_argument("--fraction", type=float, default=None)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds per step")
    args = parser.parse_args()
    micro = int(os.environ[protocol.ENV_MICRO_BATCH])
    ids = {"pid": os.getpid(), "rank": None, "local_rank": None, "world_size": None}
    write(protocol.encode(protocol.PROBE, state="loaded", detail="simulated", **ids))
    total = args.total_mib * MIB
    limit = int(total * args.fraction) if args.fraction else total
    allocated = (args.fixed_mib + args.per_sample_mib * micro) * MIB
    doomed = args.fail_above and micro > args.fail_above
    for step in range(1, args.steps + 1):
        if doomed and step == 3:
            write(protocol.encode(protocol.OOM, device="cuda:0", step=step, requested_bytes=args.per_sample_mib * MIB,
                                  allocated_bytes=limit - 100 * MIB, reserved_bytes=limit - 40 * MIB,
                                  free_bytes=40 * MIB, total_bytes=total, fraction=args.fraction, micro_batch=micro,
                                  **ids))
            print("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>", file=sys.stderr)
            print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {args.per_sample_mib}.00 MiB.",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(args.pace)
        print(f"step {step * 10}: loss {1.0 / step:.3f}", flush=True)  # looks like a step; is not the count
        write(protocol.encode(protocol.STEP, step=step, steps=1, seconds=args.pace, rss_bytes=200 * MIB,
                              devices={"cuda:0": {"allocated_peak": allocated, "reserved_peak": allocated + 64 * MIB,
                                                  "limit_bytes": limit}}, **ids))
    print(f"done micro={micro} steps={args.steps}", flush=True)
    return 0


def write(line: str) -> None:
    """Append one record as the probe does: one write on an O_APPEND file."""
    fd = os.open(os.environ[protocol.ENV_EVENTS], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
