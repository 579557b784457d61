"""The dashboard's FastAPI app: read endpoints, a live stream, metrics and control.

Tested in tests/e2e/web/test_web_api.py and tests/e2e/web/test_web_server.py.

``create_app`` is a factory so tests, the supervisor and a read-only viewer of an old run
directory (``control=None``) each build their own. Every read goes through a per-thread read-only
journal connection, so a slow request can never hold the lock the supervision loop writes under.
"""

from __future__ import annotations

import hmac
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.middleware.trustedhost import TrustedHostMiddleware

from oomguard.supervisor.record.picture import Attempt, supervisor_alive
from oomguard.web import exposure as redact
from oomguard.web import models
from oomguard.web.exposure import ANONYMOUS
from oomguard.web.journals import JournalPool, JournalUnavailable, StatusCache
from oomguard.web.logtail import log_path, tail
from oomguard.web.metrics import make_registry
from oomguard.web.sse import ChangeBroker, TooManyStreams, stream
from oomguard.web.timeline import MarkerScan, chart_point, downsample

STATIC = Path(__file__).parent / "static"
MAX_ATTEMPT = 1_000_000
MAX_ID = 2**62
FINAL_CHECKPOINTS = 20  # in a stream's `end` event: as many as /api/checkpoints gives by default
MAX_TIME = 1e11  # year 5138: any larger "time" is a client error, not a query
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


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


_UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: {"model": models.ProblemView,
                                                       "description": "no journal yet, or it is busy"}}


def _attempts(pool: JournalPool) -> list[dict[str, Any]]:
    """Every attempt as the picture has it (an old journal's endings migrated), without its log's path."""
    attempts = [Attempt.of(row) for row in pool.get().attempts()]
    return [{**{k: v for k, v in a.row().items() if k != "log_path"}, "command": redact.argv(list(a.command)),
             "exit": a.exit if a.ended else None} for a in attempts]


def _add_read_routes(app: FastAPI, pool: JournalPool, live: Any = None) -> None:
    status = StatusCache(pool)

    @app.get("/api/status", response_model=models.Status, responses=_UNAVAILABLE, tags=["read"])
    def get_status() -> Response:
        """The run's state, batch plan and failures: the document ``oomguard status --json`` prints."""
        body = status.get()
        if live is not None and (active := live.active()):  # newer than the journal when it is what failed
            body = models.STATUS.dump_json(models.STATUS.validate_python({**json.loads(body), "degraded": active}))
        return Response(body, media_type="application/json")

    @app.get("/api/attempts", response_model=list[models.Attempt], responses=_UNAVAILABLE, tags=["read"])
    def get_attempts() -> list[dict[str, Any]]:
        """Every attempt: its batch, how it ended (kind, evidence) and what was decided."""
        return _attempts(pool)

    @app.get("/api/events", response_model=list[models.Event], responses=_UNAVAILABLE, tags=["read"])
    def get_events(since: Annotated[int, Query(ge=0, le=MAX_ID, description="events after this id")] = 0,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> list[dict[str, Any]]:
        """Journal events (state changes, decisions, checkpoints, worker records) after an id."""
        return pool.get().events(since, limit)


def _add_chart_routes(app: FastAPI, pool: JournalPool, markers: MarkerScan) -> None:
    """What the dashboard's memory chart draws: the samples and the markers over them."""

    @app.get("/api/samples", response_model=models.Samples, responses=_UNAVAILABLE, tags=["read"])
    def get_samples(start: Annotated[float | None, Query(ge=0, le=MAX_TIME, allow_inf_nan=False,
                                                         description="Unix time")] = None,
                    end: Annotated[float | None, Query(ge=0, le=MAX_TIME, allow_inf_nan=False)] = None,
                    max_points: Annotated[int, Query(ge=2, le=5000)] = 600) -> dict[str, Any]:
        """Memory over a time range, downsampled to at most ``max_points`` keeping the peaks."""
        rows = pool.get().samples(start, end, max_points=10**9)
        points = [chart_point(r) for r in rows]
        return {"points": downsample(points, max_points), "total": len(points)}

    @app.get("/api/markers", response_model=list[models.Marker], responses=_UNAVAILABLE, tags=["read"])
    def get_markers() -> list[dict[str, Any]]:
        """Chart markers: OOMs and other failures, restarts, batch changes, checkpoints."""
        return markers.markers(pool.get())


def _add_file_routes(app: FastAPI, pool: JournalPool, run_dir: Path) -> None:
    """The files the run wrote (checkpoints, an attempt's log), and the health probe."""

    @app.get("/api/checkpoints", response_model=list[models.CheckpointView], responses=_UNAVAILABLE,
             tags=["read"])
    def get_checkpoints(limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> list[dict[str, Any]]:
        """Checkpoints seen, newest first (bad ones flagged with the reason)."""
        return pool.get().checkpoints()[:limit]

    @app.get("/api/attempts/{attempt}/log", response_model=models.LogTail, tags=["read"],
             responses={404: {"model": models.ProblemView, "description": "no log for that attempt"}})
    def get_log(attempt: Annotated[int, PathParam(ge=1, le=MAX_ATTEMPT)],
                lines: Annotated[int, Query(ge=1, le=5000)] = 200) -> dict[str, Any]:
        """The last lines of one attempt's log. Attempts are named by number only, never by path."""
        path = log_path(run_dir, attempt)
        if path is None:
            raise HTTPException(404, f"no log for attempt {attempt}")
        text, size, truncated = tail(path, lines)
        return {"attempt": attempt, "lines": [redact.text(line) for line in text], "size": size,
                "truncated": truncated}

    @app.get("/healthz", response_model=models.Health, tags=["read"])
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
                        503: {"model": models.ProblemView, "description": "too many live streams"}})
    async def live(since: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
                   last_event_id: Annotated[int | None, Header(ge=0, le=MAX_ID)] = None) -> Response:
        """Server-sent events of changes; reconnecting clients resume after ``Last-Event-ID``."""
        start = last_event_id if last_event_id is not None else since
        try:
            body = stream(pool, broker, start, tables)
            first = await anext(body)  # subscribes now, so "too many" is an error, not a broken stream
        except TooManyStreams as exc:
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
        401: {"model": models.ProblemView, "description": "no bearer token"},
        403: {"model": models.ProblemView, "description": "wrong token, or control disabled"},
        503: {"model": models.ProblemView, "description": "no supervisor to control"}}

    def act(what: Literal["checkpoint", "restart", "stop"]) -> dict[str, Any]:
        if control is None:
            raise HTTPException(503, "this server is not attached to a running supervisor")
        {"checkpoint": control.request_checkpoint, "restart": control.request_restart,
         "stop": control.request_stop}[what]()
        return {"requested": what, "accepted": True}

    for what, doc in (("checkpoint", "Ask the worker to write a checkpoint now."),
                      ("restart", "Stop the worker and start it again (from the newest checkpoint)."),
                      ("stop", "Stop the worker and the supervisor gracefully.")):
        app.post(f"/api/control/{what}", response_model=models.ControlResult, status_code=202,
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
