"""The API's response shapes, for the OpenAPI schema and for clients that read it.

Tested in tests/e2e/web/test_web_fuzz.py (the OpenAPI schema), tests/e2e/web/test_web_api.py and
tests/unit/web/test_models.py.

The journal's rows allow extra fields: the journal grows (GPU figures, new columns) and the API
passes new fields through rather than hiding them until this file catches up. The status document
is not written here: its schema is ``record/status.StatusDoc``, and /api/status is validated by it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter

from oomguard.supervisor.record.status import FailureRecord, StatusDoc


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


# The status document's one schema is its dataclass (record/status.py); FastAPI and pydantic read
# the dataclass for the OpenAPI schema and for validating what /api/status returns.
FailureView = FailureRecord
Status = StatusDoc
STATUS = TypeAdapter(StatusDoc)


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
