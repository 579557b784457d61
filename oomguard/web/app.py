"""The dashboard's FastAPI app: read endpoints, a live stream, metrics and control, and the shapes
of what it answers (for the OpenAPI schema and the clients that read it).

Tested in tests/unit/web/test_app.py, tests/e2e/web/test_web_api.py, tests/e2e/web/test_web_server.py
and tests/e2e/web/test_web_fuzz.py (the OpenAPI schema, and the log tail).

``create_app`` is a factory so tests, the supervisor and a read-only viewer of an old run
directory (``control=None``) each build their own. Every read goes through a per-thread read-only
journal connection, so a slow request can never hold the lock the supervision loop writes under.

The journal's rows allow extra fields: the journal grows (GPU figures, new columns) and the API
passes new fields through rather than hiding them until this file catches up. The status
document's schema is ``record/status.StatusDoc``, and /api/status is validated by it. A log is found
by attempt number only: the client never names a path.
"""

from __future__ import annotations

import hmac
import json
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, TypeAdapter
from starlette.middleware.trustedhost import TrustedHostMiddleware

from oomguard.supervisor.record import picture
from oomguard.supervisor.record.picture import supervisor_alive
from oomguard.supervisor.record.status import StatusDoc, status_document
from oomguard.web import exposure as redact
from oomguard.web import journals
from oomguard.web.exposure import ANONYMOUS
from oomguard.web.journals import ChangeBroker, JournalPool, JournalUnavailable, MarkerScan, stream
from oomguard.web.metrics import make_registry

STATIC = Path(__file__).parent / "static"
MAX_ATTEMPT = 1_000_000
MAX_ID = 2**62
FINAL_CHECKPOINTS = 20  # in a stream's `end` event: as many as /api/checkpoints gives by default
MAX_TIME = 1e11  # year 5138: any larger "time" is a client error, not a query
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


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


class StatusCache:
    """The status document as JSON bytes, rebuilt only when the journal files changed.

    Scripts poll status many times a second; rebuilding it costs SQL, psutil and serialisation under
    the GIL the supervision loop shares. A stat of the two journal files says whether anything was
    committed; ``max_age`` bounds staleness of ``supervisor_alive``, which no commit announces.
    """

    def __init__(self, pool: JournalPool, max_age: float = 1.0) -> None:
        self.pool = pool
        self.max_age = max_age
        self._lock = threading.Lock()
        self._key: tuple[int, ...] | None = None
        self._at = 0.0
        self._body = b""

    def get(self) -> bytes:
        key, now = journals.journal_key(self.pool.path), time.monotonic()  # before reading: a later commit re-keys
        with self._lock:
            if key == self._key and now - self._at < self.max_age:
                return self._body
        # Validated by the API's model: what /api/status returns is what its schema says.
        doc = STATUS.validate_python(redact.status(status_document(self.pool.get())))
        body = STATUS.dump_json(doc)
        with self._lock:
            self._key, self._at, self._body = key, now, body
        return body


MAX_BYTES = 512 * 1024  # never read more than this from the end, however long the log


def log_path(run_dir: Path, attempt: int) -> Path | None:
    logs = (run_dir / "logs").resolve()
    path = (logs / f"attempt-{int(attempt)}.log").resolve()
    if path.parent != logs or not path.is_file() or path.stat().st_nlink > 1:
        return None  # a hard link in logs/ may name any file of the machine: never served
    return path


def tail(path: Path, lines: int, max_bytes: int = MAX_BYTES) -> tuple[list[str], int, bool]:
    """The last ``lines`` lines (at most ``max_bytes`` read), the file size, and whether cut."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        start = max(0, size - max_bytes)
        fh.seek(start)
        text = fh.read(max_bytes).decode("utf-8", errors="replace")
    parts = text.splitlines()
    if start > 0 and parts:
        parts = parts[1:]  # the first line read is probably a partial one
    return parts[-lines:], size, start > 0 or len(parts) > lines


class Control(Protocol):
    """What the control endpoints need of the supervisor: each call only sets a flag."""

    def request_checkpoint(self) -> None: ...

    def request_restart(self) -> None: ...

    def request_stop(self) -> None: ...


def create_app(run_dir: Path, control: Control | None, token: str | None, *,
               broker: ChangeBroker | None = None, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The app for one run directory. ``token=None`` disables the control endpoints."""
    pool = JournalPool(Path(run_dir))
    broker = broker or ChangeBroker()
    app = FastAPI(title="oomguard", version="1", summary="A supervised training run: state, memory, "
                  "failures and control.", docs_url="/api/docs", redoc_url=None,
                  openapi_url="/api/openapi.json")
    app.state.pool, app.state.broker = pool, broker
    app.router.add_event_handler("shutdown", pool.close)
    if allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    _add_error_handlers(app)
    markers = MarkerScan()
    _add_read_routes(app, pool, getattr(control, "degradations", None))
    _add_chart_routes(app, pool, markers)
    _add_file_routes(app, pool, Path(run_dir))
    _add_live_routes(app, pool, markers, broker)
    _add_control_routes(app, control, token)
    _add_page(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        # No journal yet, or SQLite busy past its timeout: a retryable condition, not a bug.
        return JSONResponse({"detail": f"journal unavailable: {exc}"}, status_code=503,
                            headers={"Retry-After": "1"})

    app.add_exception_handler(JournalUnavailable, unavailable)
    app.add_exception_handler(sqlite3.OperationalError, unavailable)


_UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: {"model": ProblemView,
                                                       "description": "no journal yet, or it is busy"}}


def _attempts(pool: JournalPool) -> list[dict[str, Any]]:
    """Every attempt as the picture has it (an old journal's endings migrated), without its log's path."""
    attempts = [picture.Attempt.of(row) for row in pool.get().attempts()]
    return [{**{k: v for k, v in a.row().items() if k != "log_path"}, "command": redact.argv(list(a.command)),
             "exit": a.exit if a.ended else None} for a in attempts]


def _add_read_routes(app: FastAPI, pool: JournalPool, live: Any = None) -> None:
    status = StatusCache(pool)

    @app.get("/api/status", response_model=StatusDoc, responses=_UNAVAILABLE, tags=["read"])
    def get_status() -> Response:
        """The run's state, batch plan and failures: the document ``oomguard status --json`` prints."""
        body = status.get()
        if live is not None and (active := live.active()):  # newer than the journal when it is what failed
            body = STATUS.dump_json(STATUS.validate_python({**json.loads(body), "degraded": active}))
        return Response(body, media_type="application/json")

    @app.get("/api/attempts", response_model=list[Attempt], responses=_UNAVAILABLE, tags=["read"])
    def get_attempts() -> list[dict[str, Any]]:
        """Every attempt: its batch, how it ended (kind, evidence) and what was decided."""
        return _attempts(pool)

    @app.get("/api/events", response_model=list[Event], responses=_UNAVAILABLE, tags=["read"])
    def get_events(since: Annotated[int, Query(ge=0, le=MAX_ID, description="events after this id")] = 0,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> list[dict[str, Any]]:
        """Journal events (state changes, decisions, checkpoints, worker records) after an id."""
        return pool.get().events(since, limit)


def _add_chart_routes(app: FastAPI, pool: JournalPool, markers: MarkerScan) -> None:
    """What the dashboard's memory chart draws: the samples and the markers over them."""

    @app.get("/api/samples", response_model=Samples, responses=_UNAVAILABLE, tags=["read"])
    def get_samples(start: Annotated[float | None, Query(ge=0, le=MAX_TIME, allow_inf_nan=False,
                                                         description="Unix time")] = None,
                    end: Annotated[float | None, Query(ge=0, le=MAX_TIME, allow_inf_nan=False)] = None,
                    max_points: Annotated[int, Query(ge=2, le=5000)] = 600) -> dict[str, Any]:
        """Memory over a time range, downsampled to at most ``max_points`` keeping the peaks."""
        rows = pool.get().samples(start, end, max_points=10**9)
        points = [journals.chart_point(r) for r in rows]
        return {"points": journals.downsample(points, max_points), "total": len(points)}

    @app.get("/api/markers", response_model=list[Marker], responses=_UNAVAILABLE, tags=["read"])
    def get_markers() -> list[dict[str, Any]]:
        """Chart markers: OOMs and other failures, restarts, batch changes, checkpoints."""
        return markers.markers(pool.get())


def _add_file_routes(app: FastAPI, pool: JournalPool, run_dir: Path) -> None:
    """The files the run wrote (checkpoints, an attempt's log), and the health probe."""

    @app.get("/api/checkpoints", response_model=list[CheckpointView], responses=_UNAVAILABLE,
             tags=["read"])
    def get_checkpoints(limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> list[dict[str, Any]]:
        """Checkpoints seen, newest first (bad ones flagged with the reason)."""
        return pool.get().checkpoints()[:limit]

    @app.get("/api/attempts/{attempt}/log", response_model=LogTail, tags=["read"],
             responses={404: {"model": ProblemView, "description": "no log for that attempt"}})
    def get_log(attempt: Annotated[int, PathParam(ge=1, le=MAX_ATTEMPT)],
                lines: Annotated[int, Query(ge=1, le=5000)] = 200) -> dict[str, Any]:
        """The last lines of one attempt's log. Attempts are named by number only, never by path."""
        path = log_path(run_dir, attempt)
        if path is None:
            raise HTTPException(404, f"no log for attempt {attempt}")
        text, size, truncated = tail(path, lines)
        return {"attempt": attempt, "lines": [redact.text(line) for line in text], "size": size,
                "truncated": truncated}

    @app.get("/healthz", response_model=Health, tags=["read"])
    def healthz(request: Request) -> dict[str, Any]:
        """Is the server up, and can it read the journal? (200 either way; ``ok`` says.) The one read
        open without the token on a network bind, for probes: the run's ``state`` is then left out."""
        try:
            meta = pool.get().meta()
        except (JournalUnavailable, sqlite3.Error):
            return {"ok": False, "state": None, "supervisor_alive": False}
        state = None if request.scope.get(ANONYMOUS) else meta.get("state")
        return {"ok": True, "state": state, "supervisor_alive": supervisor_alive(meta)}


def _add_live_routes(app: FastAPI, pool: JournalPool, markers: MarkerScan, broker: ChangeBroker) -> None:
    registry = make_registry(pool.get)

    def tables() -> dict[str, Any]:  # what /api/attempts, /api/markers and /api/checkpoints answer
        return {"attempts": _attempts(pool), "markers": markers.markers(pool.get()),
                "checkpoints": pool.get().checkpoints()[:FINAL_CHECKPOINTS]}

    @app.get("/metrics", response_class=Response, tags=["read"],
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}})
    def metrics() -> Response:
        """Prometheus metrics, all named ``oomguard_*``."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/stream", response_class=StreamingResponse, tags=["read"],
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "events `status`, `journal` (with ids) and `sample`; "
                                             "when the server stops, `end` (why, and the final "
                                             "attempts, markers and checkpoints)"},
                        503: {"model": ProblemView, "description": "too many live streams"}})
    async def live(since: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
                   last_event_id: Annotated[int | None, Header(ge=0, le=MAX_ID)] = None) -> Response:
        """Server-sent events of changes; reconnecting clients resume after ``Last-Event-ID``."""
        start = last_event_id if last_event_id is not None else since
        try:
            body = stream(pool, broker, start, tables)
            first = await anext(body)  # subscribes now, so "too many" is an error, not a broken stream
        except journals.TooManyStreams as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        return StreamingResponse(_prepend(first, body), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


_bearer = HTTPBearer(auto_error=False, description="the token in RUN_DIR/token")


def _authorizer(token: str | None) -> Callable[..., None]:
    def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if credentials is None:
            raise HTTPException(401, "a bearer token is required (see RUN_DIR/token)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not token:
            raise HTTPException(403, "control is disabled on this server")
        # Constant time, on bytes: str compare_digest refuses non-ASCII, and the header is untrusted.
        if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
            raise HTTPException(403, "wrong token")

    return authorize


def _add_control_routes(app: FastAPI, control: Control | None, token: str | None) -> None:
    authorize = _authorizer(token)
    problems: dict[int | str, dict[str, Any]] = {
        401: {"model": ProblemView, "description": "no bearer token"},
        403: {"model": ProblemView, "description": "wrong token, or control disabled"},
        503: {"model": ProblemView, "description": "no supervisor to control"}}

    def act(what: Literal["checkpoint", "restart", "stop"]) -> dict[str, Any]:
        if control is None:
            raise HTTPException(503, "this server is not attached to a running supervisor")
        {"checkpoint": control.request_checkpoint, "restart": control.request_restart,
         "stop": control.request_stop}[what]()
        return {"requested": what, "accepted": True}

    for what, doc in (("checkpoint", "Ask the worker to write a checkpoint now."),
                      ("restart", "Stop the worker and start it again (from the newest checkpoint)."),
                      ("stop", "Stop the worker and the supervisor gracefully.")):
        app.post(f"/api/control/{what}", response_model=ControlResult, status_code=202,
                 dependencies=[Depends(authorize)], responses=problems, tags=["control"],
                 summary=doc, operation_id=f"control_{what}")(_bind(act, what))


def _bind(act: Callable[[Any], dict[str, Any]], what: str) -> Callable[[], dict[str, Any]]:
    """A parameterless endpoint (a default argument would become a query parameter)."""
    def endpoint() -> dict[str, Any]:
        return act(what)

    return endpoint


def _add_page(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": CSP,
                                                           "Cache-Control": "no-cache"})
