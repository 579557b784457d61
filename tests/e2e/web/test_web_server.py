"""The server's own rules, in-process: ports, exposure, token file, signals, shutdown."""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import REPO, WORKER

from oomguard.supervisor.cli import build_parser
from oomguard.supervisor.config import build_config
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import Degradations, Journal
from oomguard.supervisor.run.loop import Supervisor
from oomguard.web import server as server_module
from oomguard.web.server import check_exposure, start_dashboard, start_server, stop_dashboard


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    Journal(tmp_path).close()  # an empty journal, as a supervisor leaves it before the first attempt
    return tmp_path


@pytest.fixture()
def busy_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


class FakeControl:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def request_checkpoint(self) -> None:
        self.calls.append("checkpoint")

    def request_restart(self) -> None:
        self.calls.append("restart")

    def request_stop(self) -> None:
        self.calls.append("stop")


def test_serves_in_a_thread_without_touching_signal_handlers(run_dir: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    control = FakeControl()
    web = start_server(run_dir, control, "127.0.0.1", 0)
    try:
        assert {s: signal.getsignal(s) for s in before} == before
        assert httpx.get(web.url + "healthz").json()["ok"] is True
        auth = {"Authorization": f"Bearer {web.token}"}
        assert httpx.post(web.url + "api/control/checkpoint", headers=auth).status_code == 202
        assert control.calls == ["checkpoint"]
        token_file = run_dir / "token"
        assert token_file.read_text().strip() == web.token
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    finally:
        web.stop()
    assert not web.thread.is_alive()


def test_stop_is_quick_with_a_live_stream_open(run_dir: Path) -> None:
    web = start_server(run_dir, None, "127.0.0.1", 0)
    opened = threading.Event()

    def listen() -> None:
        try:
            with httpx.stream("GET", web.url + "api/stream", timeout=10) as response:
                for _ in response.iter_lines():
                    opened.set()
        except httpx.HTTPError:
            opened.set()

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    assert opened.wait(5)
    web.stop(timeout=4)
    assert not web.thread.is_alive()
    reader.join(5)
    assert not reader.is_alive()


def test_a_stream_ends_with_the_final_tables_and_why_before_the_server_goes(run_dir: Path) -> None:
    """Pages cannot ask a stopped server for anything: its streams' last event carries what they show."""
    journal = Journal(run_dir)
    journal.start_attempt(1, 4242, {"micro_batch": 4, "grad_accum": 2, "global_batch": 8, "world_size": 1},
                          None, ["python", "train.py"], str(run_dir / "logs" / "attempt-1.log"))
    web = start_server(run_dir, None, "127.0.0.1", 0)
    lines: list[str] = []
    opened = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", web.url + "api/stream", timeout=10) as response:
            for line in response.iter_lines():
                lines.append(line)
                opened.set()

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    try:
        assert opened.wait(5)
        journal.end_attempt(1, returncode=0, exit_code=0)
        journal.transition("running", "succeeded", "training finished", 1)
        web.stop(why="The supervisor has exited.")
        reader.join(5)
        assert not reader.is_alive()
    finally:
        web.stop()
        journal.close()
    end = lines.index("event: end")
    assert '"to": "succeeded"' in "".join(lines[:end])  # the final records first
    final = json.loads(lines[end + 1].removeprefix("data: "))
    assert final["why"] == "The supervisor has exited."
    assert [(a["attempt"], a["exit"]) for a in final["attempts"]] == [(1, "exit 0")]
    assert final["markers"] == [] and final["checkpoints"] == []  # one clean attempt: nothing to mark


def test_port_in_use_is_a_clear_error(run_dir: Path, busy_port: int) -> None:
    with pytest.raises(UsageError, match=f"127.0.0.1:{busy_port} is already in use"):
        start_server(run_dir, None, "127.0.0.1", busy_port)


def test_default_port_in_use_falls_back_to_a_free_one(run_dir: Path, busy_port: int) -> None:
    web = start_server(run_dir, None, "127.0.0.1", busy_port, fallback=True)
    try:
        assert not web.url.endswith(f":{busy_port}/")
        assert httpx.get(web.url + "healthz").status_code == 200
    finally:
        web.stop()


def test_cli_port_in_use_is_one_line_exit_2(tmp_path: Path, busy_port: int) -> None:
    result = subprocess.run([sys.executable, "-m", "oomguard", "run", "--run-dir", str(tmp_path / "r"),
                             "--micro-batch", "1", "--grad-accum", "1", "--port", str(busy_port), "--",
                             sys.executable, str(WORKER)], cwd=REPO, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("oomguard: error:")]
    assert len(errors) == 1 and "is already in use" in errors[0], result.stderr


def test_no_token_on_a_public_address_is_refused() -> None:
    with pytest.raises(UsageError, match="without a control token"):
        check_exposure("0.0.0.0", None)
    check_exposure("127.0.0.1", None)
    check_exposure("::1", None)
    check_exposure("0.0.0.0", "secret")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette's TestClient on plain httpx
def test_without_a_token_control_is_disabled(run_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from oomguard.web.app import create_app

    control = FakeControl()
    client = TestClient(create_app(run_dir, control, None))
    assert client.post("/api/control/stop", headers={"Authorization": "Bearer x"}).status_code == 403
    assert client.post("/api/control/stop").status_code == 401
    assert control.calls == []


def test_a_crashed_dashboard_is_said_once_and_served_again_on_its_port(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The server thread dies of a bug: the run goes on, the degradation is said, and the dashboard
    comes back at the same URL with the same token; the supervisor never waits on it."""
    monkeypatch.setattr(server_module, "RESTART_FIRST", 0.2)
    options = vars(build_parser().parse_args(["run", "--run-dir", str(tmp_path / "run"), "--micro-batch", "4",
                                              "--grad-accum", "1", "--port", "0"]))
    config = build_config({k: v for k, v in options.items() if k not in ("func", "subcommand")},
                          [sys.executable, "-c", "pass"])
    said: list[str] = []
    sup = Supervisor(config)
    sup.degradations = Degradations(said.append)
    sup.open()
    dashboard = start_dashboard(sup)
    url, token = dashboard.web.url, dashboard.web.token
    try:
        assert httpx.get(url + "healthz").json()["ok"] is True

        async def boom(counter: int) -> bool:
            raise RuntimeError("injected fault in the server loop")

        dashboard.web.server.on_tick = boom  # type: ignore[method-assign]
        dashboard.web.thread.join(5)
        assert not dashboard.web.thread.is_alive()
        for ticker in sup.tickers:
            ticker()
        [problem] = sup.degradations.active()
        assert problem["component"] == "web" and "injected fault" in problem["message"]
        assert sup.journal.meta().get("web_url") is None  # status does not send anyone to a dead port
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "healthz")
        deadline = time.monotonic() + 10
        while sup.degradations.active() and time.monotonic() < deadline:
            time.sleep(0.1)
            for ticker in sup.tickers:
                ticker()
        assert not sup.degradations.active() and dashboard.restarts == 1
        assert dashboard.web.url == url and dashboard.web.token == token
        assert httpx.get(url + "healthz").json()["ok"] is True
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(url + "api/status", headers=auth).status_code == 200
        assert sup.journal.meta()["web_url"] == url
        assert [line.split(" ", 1)[0] for line in said] == ["web", "web"]  # failed once, recovered once
    finally:
        stop_dashboard(sup, dashboard)
        sup.close()
