"""Start a real ``oomguard run`` (a subprocess) on a real worker, its dashboard on 127.0.0.1.

Shared by the tests, ``scripts/screenshot_dashboard.py`` and ``bench/web_load.py``; no pytest here.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from oomguard.supervisor.record.journal import Journal, journal_path

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).parent / "workers" / "oom_worker.py"
OOMGUARD = [sys.executable, "-m", "oomguard"]


@dataclass
class Run:
    """One supervised run: the ``oomguard run`` process, its run directory and dashboard."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    url: str
    token: str
    stderr_path: Path

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path.lstrip("/"), timeout=10, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path.lstrip("/"), timeout=10, **kw)

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = self.get("api/status").json()
        return doc

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.status()
            if predicate(doc):
                return doc
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; last status: {doc}")
            time.sleep(0.1)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*OOMGUARD, *args, "--run-dir", str(self.run_dir)], cwd=REPO, text=True,
                              capture_output=True, timeout=30, check=False)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def start_run(workdir: Path, env: dict[str, str] | None = None, micro: int = 16, global_batch: int = 64,
              extra: tuple[str, ...] = (), command: tuple[str, ...] = (sys.executable, str(WORKER))) -> Run:
    """Start ``oomguard run`` on port 0 and wait until its dashboard answers."""
    run_dir = workdir / "run"
    stderr_path = workdir / "oomguard.stderr"
    worker_env = {**os.environ, "PYTHONPATH": str(REPO), "OOMGUARD_CACHE_DIR": str(workdir / "cache"),
                  "OOM_ABOVE": "4", "OOM_AFTER": "1.2",
                  "STEP_S": "0.1", "CKPT_EVERY": "10", "CKPT_DIR": str(workdir / "ckpt"), **(env or {})}
    argv = [*OOMGUARD, "run", "--run-dir", str(run_dir), "--micro-batch", str(micro), "--global-batch",
            str(global_batch), "--checkpoint", str(workdir / "ckpt" / "step-*.pt"), "--port", "0",
            "--grace-period", "5", "--backoff", "0.2", *extra, "--", *command]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(argv, cwd=workdir, env=worker_env, stdout=subprocess.DEVNULL, stderr=err)
    url = _wait_for_url(run_dir, proc, stderr_path)
    return Run(proc, run_dir, url, (run_dir / "token").read_text().strip(), stderr_path)


def _wait_for_url(run_dir: Path, proc: subprocess.Popen[bytes], stderr_path: Path) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"oomguard run exited {proc.returncode}: {stderr_path.read_text()}")
        if journal_path(run_dir).exists():
            journal = Journal(run_dir, readonly=True)
            try:
                url = journal.meta().get("web_url")
            except sqlite3.OperationalError:  # created, schema not written yet
                url = None
            finally:
                journal.close()
            if url:
                return str(url)
        time.sleep(0.05)
    raise AssertionError("the dashboard did not come up")




@dataclass
class Fleet:
    """``oomguard dashboard DIR...``: the many-runs page, in its own process."""

    proc: subprocess.Popen[bytes]
    url: str
    stderr_path: Path

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path.lstrip("/"), timeout=10, **kw)

    def runs(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.get("api/runs").json()["runs"]
        return rows

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def start_fleet(workdir: Path, *roots: Path, host: str = "127.0.0.1") -> Fleet:
    """Start ``oomguard dashboard`` on port 0 and wait for the address it prints."""
    stderr_path = workdir / "fleet.stderr"
    argv = [*OOMGUARD, "dashboard", *map(str, roots), "--host", host, "--port", "0"]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(argv, cwd=workdir, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"oomguard dashboard exited {proc.returncode}: {stderr_path.read_text()}")
        said = stderr_path.read_text()
        if "http://" in said:
            url = said.split("http://", 1)[1].split()[0].split("(")[0]
            return Fleet(proc, "http://" + url.rstrip(";"), stderr_path)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("oomguard dashboard did not come up")
