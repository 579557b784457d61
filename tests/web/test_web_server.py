"""The server's own rules, in-process: ports, exposure, token file, signals, shutdown."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from harness import REPO, WORKER

from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.record.journal import Journal
from oomguard.web.server import check_exposure, start_server


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
