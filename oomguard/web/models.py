"""The API's response shapes, for the OpenAPI schema and for clients that read it.

Tested in tests/e2e/web/test_web_fuzz.py (the OpenAPI schema) and tests/e2e/web/test_web_api.py.

Models allow extra fields: the journal and the status document grow (GPU figures, new status
keys) and the API passes new fields through rather than hiding them until this file catches up.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CheckpointView(_Open):
    path: str
    step: int | None = None
    mtime: float
    first_seen: float
    attempt: int | None = None
    bad: int = 0
    reason: str | None = None


class FailureView(_Open):
    attempt: int
    kind: str
    micro_batch: int
    grad_accum: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    evidence: str | None = None
    decision: str | None = None
    started: float | None = None
    ended: float | None = None
    checkpoint: str | None = None
    exit: str | None = None  # how its process ended, in the words status, the report and the dashboard share


class Status(_Open):
    """The document ``oomguard status --json`` prints."""

    state: str
    reason: str
    supervisor_alive: bool
    supervisor_pid: int | None = None
    run_dir: str | None = None
    command: list[str] | None = None
    attempt: int
    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    asked_global_batch: int | None = None  # above global_batch once a script without accumulation was shrunk
    accumulates: bool = True  # False: the script takes no accumulation (global batch = micro × world)
    world_size: int | None = None
    expandable_segments: bool = False
    fallbacks_applied: int = 0
    alloc_conf: dict[str, str] | None = None  # PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF as the worker got them
    worker_pid: int | None = None  # the training process (the launcher's child), not oomguard's launch.py
    rank_pids: dict[str, int] = {}  # under torchrun or accelerate: each rank's training process, by rank
    checkpoint: str | None = None
    newest_checkpoint: CheckpointView | None = None
    progress: dict[str, Any] | None = None  # with the probe: steps_per_s, allocated_peak, limit_bytes
    peaks: list[dict[str, Any]] = []  # per attempt: peak_allocated (probe), peak_gpu (NVML), peak_rss
    liveness: dict[str, Any] | None = None  # why a silent worker is held alive, while it is
    started: float | None = None
    updated: float | None = None
    failures: list[FailureView]
    resume_command: str | None = None  # after a stop: the command that resumes the run
    warnings: list[dict[str, Any]] = []  # said once each: an attempt that did not resume, a glob that matches nothing
    own_failures: list[dict[str, Any]] = []  # oomguard's probe or spare that failed an attempt, off since
    spare: dict[str, Any] | None = None  # why no spare interpreter is held (said once a run), or none


class Attempt(_Open):
    attempt: int
    started: float
    ended: float | None = None
    pid: int | None = None
    micro_batch: int
    grad_accum: int
    global_batch: int
    world_size: int
    checkpoint: str | None = None
    command: list[str]
    expandable_segments: int = 0
    fallbacks_applied: int = 0
    returncode: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    kind: str | None = None
    evidence: str | None = None
    decision: str | None = None
    last_step: int | None = None
    peak_rss: int | None = None
    peak_gpu: int | None = None
    peak_allocated: int | None = None  # the allocator's highest step peak, from the in-process probe
    exit: str | None = None  # "exit 1", "signal 9 (SIGKILL)": as status and the report say it; None while it runs


class Event(BaseModel):
    id: int
    t: float
    kind: str
    attempt: int | None = None
    data: dict[str, Any]


class SamplePoint(BaseModel):
    t: float
    attempt: int | None = None
    host_rss: int | None = None
    cgroup_usage: int | None = None
    gpu: dict[str, int]


class Samples(BaseModel):
    points: list[SamplePoint]
    total: int


class Marker(BaseModel):
    t: float
    kind: Literal["oom", "failure", "restart", "batch", "checkpoint"]
    attempt: int | None = None
    label: str


class LogTail(BaseModel):
    attempt: int
    lines: list[str]
    size: int
    truncated: bool


class Health(BaseModel):
    ok: bool
    state: str | None = None
    supervisor_alive: bool


class ControlResult(BaseModel):
    requested: Literal["checkpoint", "restart", "stop"]
    accepted: bool


class ProblemView(BaseModel):
    detail: str
