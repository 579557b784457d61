"""The many-runs page: ``oomguard dashboard DIR…`` lists every run on a machine, live, from their journals.

Tested in tests/e2e/web/test_fleet.py.

Nothing here depends on a run's own server being up. The list is read from the journals
(``record/status.py``, the same rows as ``oomguard ls --json``), and each run's own view is served here
too, read-only, at ``/runs/<key>/``: the run dashboard's app with no control, so a finished run or
one whose supervisor was killed can still be looked at. A run whose supervisor is alive also links
to its own dashboard, the one that takes control requests (with that run's token).
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from oomguard.supervisor.record.status import MAX_DEPTH, find_runs, summarize
from oomguard.web import exposure as redact
from oomguard.web.app import CSP, STATIC, create_app
from oomguard.web.exposure import ASGIApp, Receive, Scope, Send, is_loopback
from oomguard.web.journals import ChangeBroker

SCAN_EVERY = 1.0  # seconds a listing is reused: many open pages cost one scan, not one each


def run_key(run_dir: Path) -> str:
    """A run's name in URLs: stable across scans and restarts, and no path a client could choose."""
    return hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]


def _live_link(run_dir: Path, url: str | None, guarded: bool) -> str | None:
    """The link to a live run's own dashboard. On a network bind that dashboard needs its token for
    every request: the link carries it (read from the run's directory, as ``oomguard stop`` does),
    so that it opens from the machine the page is read on rather than answering 401. Only where this
    page is itself behind its token (``guarded``: a network bind): on loopback any local account could
    open this page, and the run's token file is its owner's alone (0600)."""
    if not url or not guarded or is_loopback(urlsplit(url).hostname or ""):
        return url
    try:
        token = (run_dir / "token").read_text().strip()
    except OSError:
        return url
    return f"{url}?token={token}" if token else url


class Runs:
    """The runs under the roots, rescanned at most every ``SCAN_EVERY`` seconds, and one read-only
    app per run for its own view (made when first opened). Thread-safe."""

    def __init__(self, roots: Sequence[Path], max_depth: int = MAX_DEPTH, guarded: bool = False) -> None:
        self.roots = [Path(r).resolve() for r in roots]
        self.max_depth = max_depth
        self.guarded = guarded  # served on a network bind, where every request needs this page's token
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._dirs: dict[str, Path] = {}
        self._at = -SCAN_EVERY
        self._views: dict[str, FastAPI] = {}
        self._brokers: list[ChangeBroker] = []

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            if time.monotonic() - self._at < SCAN_EVERY:
                return self._rows
        dirs = find_runs(self.roots, self.max_depth)
        rows = [self._row(d) for d in dirs]
        with self._lock:
            self._rows, self._at = rows, time.monotonic()
            self._dirs.update({row["key"]: Path(row["run_dir"]) for row in rows})
        return rows

    def _row(self, run_dir: Path) -> dict[str, Any]:
        row = summarize(run_dir)
        key = run_key(run_dir)
        return {**row, "key": key, "name": self._name(run_dir), "view": f"runs/{key}/",
                "reason": redact.text(str(row["reason"])),
                "dashboard": _live_link(run_dir, row["dashboard"], self.guarded)}

    def _name(self, run_dir: Path) -> str:
        """The run's path below the root it was found under (the root's own name when it is the run)."""
        for root in self.roots:
            if run_dir == root:
                return root.name
            if run_dir.is_relative_to(root):
                return str(run_dir.relative_to(root))
        return str(run_dir)

    def view(self, key: str) -> FastAPI | None:
        """The read-only app of the run named ``key``, or None when no run under the roots has it."""
        with self._lock:
            known = key in self._dirs
        if not known:
            self.rows()  # a run that appeared since the last scan
        with self._lock:
            run_dir = self._dirs.get(key)
            if run_dir is None:
                return None
            if key not in self._views:
                broker = ChangeBroker()
                self._brokers.append(broker)
                self._views[key] = create_app(run_dir, control=None, token=None, broker=broker)
            return self._views[key]

    def close(self) -> None:
        """End the live streams and close every view's journal connections."""
        with self._lock:
            views, brokers = list(self._views.values()), list(self._brokers)
        for broker in brokers:
            broker.close()
        for view in views:
            view.state.pool.close()


def create_fleet_app(runs: Runs) -> FastAPI:
    app = FastAPI(title="oomguard runs", version="1", summary="Every supervised run on this machine.",
                  docs_url="/api/docs", redoc_url=None, openapi_url="/api/openapi.json")
    app.state.runs = runs
    app.router.add_event_handler("shutdown", runs.close)
    host = socket.gethostname()

    @app.get("/api/runs", tags=["read"])
    def get_runs() -> dict[str, Any]:
        """Every run found under the directories, one summary each (``oomguard ls --json``)."""
        return {"host": host, "roots": [str(r) for r in runs.roots], "time": time.time(), "runs": runs.rows()}

    @app.get("/healthz", tags=["read"])
    def healthz() -> dict[str, Any]:
        return {"ok": True, "runs": len(runs.rows())}

    app.mount("/runs/{key}", _Views(runs), name="run")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "fleet.html", headers={"Content-Security-Policy": CSP,
                                                           "Cache-Control": "no-cache"})

    return app


class _Views:
    """``/runs/<key>/…``: the run dashboard of one run, read from its journal (Starlette's mount has
    already moved the prefix into ``root_path``, so the run's app routes as if at ``/``)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from anyio import to_thread

        key = str(scope.get("path_params", {}).get("key", ""))
        view: ASGIApp | None = await to_thread.run_sync(self.runs.view, key)  # a scan reads files
        if view is None:
            await JSONResponse({"detail": f"no run {key!r} under these directories"}, 404)(scope, receive, send)
            return
        await view(scope, receive, send)
