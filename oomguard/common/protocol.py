"""The contract between the supervisor and a worker process; stdlib only.

Tested through its writers and readers: tests/unit/worker/test_session.py, tests/unit/supervisor/observe/.

The supervisor starts the training command with the environment variables below. A worker that
uses the ``worker`` library (or any script) may speak back by appending JSON records, one per
line, to the file named by ``OOMGUARD_EVENTS``. Every record has ``type`` and ``t`` (Unix time);
the other fields per type are listed in ``RECORD_FIELDS``. The supervisor asks for a checkpoint by
creating the file named by ``OOMGUARD_CHECKPOINT_REQUEST`` and sending the signal named by
``OOMGUARD_CHECKPOINT_SIGNAL``; the worker deletes the file once the checkpoint is written.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

# Batch arithmetic and resume point, set for every attempt.
ENV_MICRO_BATCH = "OOMGUARD_MICRO_BATCH"
ENV_GRAD_ACCUM = "OOMGUARD_GRAD_ACCUM"
ENV_GLOBAL_BATCH = "OOMGUARD_GLOBAL_BATCH"
ENV_WORLD_SIZE = "OOMGUARD_WORLD_SIZE"
ENV_CHECKPOINT = "OOMGUARD_CHECKPOINT"  # empty when there is none
ENV_CHECKPOINT_STEP = "OOMGUARD_CHECKPOINT_STEP"  # empty when unknown
ENV_ATTEMPT = "OOMGUARD_ATTEMPT"
ENV_RUN_DIR = "OOMGUARD_RUN_DIR"
# The channel back to the supervisor.
ENV_EVENTS = "OOMGUARD_EVENTS"
ENV_CHECKPOINT_REQUEST = "OOMGUARD_CHECKPOINT_REQUEST"
ENV_CHECKPOINT_SIGNAL = "OOMGUARD_CHECKPOINT_SIGNAL"

# Record types a worker may write, and the fields each carries (besides type and t).
PROGRESS = "progress"  # step, samples, loss, micro_batch, grad_accum, samples_per_s, peak_gpu_bytes,
#                        rss_bytes, total_steps (all optional but step)
HEARTBEAT = "heartbeat"  # step
CHECKPOINT = "checkpoint"  # path, step
FAILURE = "failure"  # kind (cuda_oom | host_oom | cuda_fatal | crash), message, micro_batch
BATCH = "batch"  # micro_batch, grad_accum, reason (oom | grow | grow_failed | resume)
# Written by the in-process probe (oomguard/probe/), which the supervisor loads into every Python
# process of the worker through a sitecustomize on PYTHONPATH. Every probe record also carries pid,
# rank, local_rank and world_size (None outside a launcher).
PROBE = "probe"  # state (loaded | off | failed | partial), detail: once per process that trains, on failures, and
#                   once per part it does not do there by design (partial: forward figures, compiled steps)
STEP = "step"  # step (the optimizer step reached, resumed count included), steps (optimizer steps since the
#                last step record), seconds (wall time those steps took), rss_bytes, and per CUDA device
#                "cuda:N": allocated_peak, reserved_peak (the allocator's peaks as it reports them: since the
#                process started or the program's own reset_peak_memory_stats; the probe never resets them),
#                limit_bytes (the per-process fraction's cap, else total) in the mapping ``devices``;
#                vm_limit_bytes (RLIMIT_AS, or None) and, under it, vm_peak_bytes (the address space's peak);
#                held_after_first_step: {"address_space"|"rss"|"cuda_allocated": bytes} read right after the
#                process's first optimizer step (weights, gradients, optimizer state), once it is known
SAVE = "save"  # path (the file torch.save was given, absolute; None for a file object), step (the optimizer
#                step reached when the save began; None before the process's first optimizer step),
#                started (Unix time it began; ``t`` is when it returned): a checkpoint file whose mtime
#                lies between was written at that step
OOM = "oom"  # device ("cuda:N" | "cpu"), step, requested_bytes, allocated_bytes, reserved_bytes, free_bytes,
#              total_bytes, fraction (set_per_process_memory_fraction, or None), micro_batch: at a CUDA OOM,
#              from torch's OOM observer; at an uncaught out-of-memory exception, what is known.
#              memory: what allocated_bytes, total_bytes and fixed_bytes count ("cuda_allocated"; on the host
#              "address_space" under RLIMIT_AS, total_bytes its limit, else "rss", total_bytes None);
#              fixed_bytes: held before the step's first forward; forward_fraction: the share of the forward
#              done (1.0 once it returned), forward_basis ("learned" | "modules" | "done"), forward_leaves
#              (leaf-module forwards run); all None where unknown (the probe's forward hooks: first step only)
MODEL = "model"  # digest (of the optimizer's class and its parameters: per tensor shape, dtype, requires_grad, in
#                  order), params (elements), tensors, optimizer (class name): once per process, at its first
#                  optimizer step, of the optimizer that stepped first; the fit store tells two models apart by it
MEMORY = "memory"  # at ("oom" | "peak"), device ("cuda:N" | "cpu"), micro_batch, and in bytes (None where unknown):
#                    weights (every parameter), frozen_weights (those with requires_grad False, inside weights),
#                    gradients, optimizer_state (every tensor in the optimizers' state), optimizers (class names),
#                    activations (the rest: CUDA allocated less those; on the host the process's memory less
#                    baseline and those), cache (CUDA reserved less allocated; None on the host), total, limit,
#                    limit_kind ("gpu" | "RLIMIT_AS" | None), measure (memory.py's), baseline (the host's memory
#                    when torch finished importing), requested (at an OOM); at a CUDA OOM while the allocator's
#                    history was recorded: snapshot (the pickle's path), stacks (largest allocations by stack)

RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    PROGRESS: ("step",),
    HEARTBEAT: ("step",),
    CHECKPOINT: ("path", "step"),
    FAILURE: ("kind", "message"),
    BATCH: ("micro_batch", "grad_accum", "reason"),
    PROBE: ("state", "pid"),
    STEP: ("step", "steps", "pid"),
    SAVE: ("step", "started", "pid"),
    OOM: ("device", "pid"),
    MODEL: ("digest", "params", "pid"),
    MEMORY: ("at", "device", "pid"),
}


def encode(record_type: str, **fields: Any) -> str:
    """One channel line (with its newline) for a record; raises ValueError on missing fields."""
    missing = [f for f in RECORD_FIELDS.get(record_type, ()) if f not in fields]
    if record_type not in RECORD_FIELDS or missing:
        raise ValueError(f"bad {record_type!r} record: missing {missing}")
    return json.dumps({"type": record_type, "t": time.time(), **fields}, separators=(",", ":")) + "\n"


def decode(line: str) -> dict[str, Any] | None:
    """The record in one channel line, or None for a torn or foreign line (never raises)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("type") not in RECORD_FIELDS:
        return None
    return record


def emit(record_type: str, **fields: Any) -> bool:
    """Append a record to this process's channel; False when not run under the supervisor.

    One ``os.write`` of a line under PIPE_BUF on an O_APPEND file is atomic, so concurrent
    writers (dataloader workers, ranks) never interleave within a line.
    """
    path = os.environ.get(ENV_EVENTS)
    if not path:
        return False
    data = encode(record_type, **fields).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


# ----- reading what the supervisor set: integers in the environment, signals by name


def env_int(name: str) -> int | None:
    """An integer the supervisor set in the environment, or None where it is unset or blank.

    A value that is not an integer is a wiring mistake: said with the variable's name, never guessed.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def signal_name(name: str) -> str | None:
    """A signal's full name (``usr1``, ``SIGUSR1`` -> ``SIGUSR1``), or None where none is called so here."""
    name = name.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    return name if isinstance(getattr(signal, name, None), signal.Signals) else None


def signal_number(name: str) -> int | None:
    """A signal given by name or number (``OOMGUARD_CHECKPOINT_SIGNAL``), or None where empty or unknown."""
    name = name.strip()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    full = signal_name(name)
    return None if full is None else int(signal.Signals[full])
