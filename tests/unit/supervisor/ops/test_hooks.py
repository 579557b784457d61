"""ops/hooks.py: sd_notify messages against a real AF_UNIX datagram socket, path and abstract namespace;
the status line: pure formatting, plain (journald) mode, a real pseudo-terminal, and tmux."""

from __future__ import annotations

import io
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.supervisor.ops.hooks import (
    EtaEstimator,
    StatusLine,
    SystemdNotifier,
    Watchdog,
    format_duration,
    status_parts,
    watchdog_interval,
)


class Receiver:
    """What systemd does: a bound datagram socket collecting messages."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(2.0)

    def recv(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")

    def pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return False
        finally:
            self.sock.settimeout(2.0)
        return True


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[Receiver, str]]:
    path = str(tmp_path / "notify.sock")
    rx = Receiver(path)
    yield rx, path
    rx.sock.close()


def test_ready_status_stopping(receiver: tuple[Receiver, str]) -> None:
    rx, path = receiver
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("running attempt 1 at micro-batch 8")
    assert rx.recv() == ["READY=1", "STATUS=running attempt 1 at micro-batch 8"]
    assert notifier.status("recovering:\ncuda_oom  at 8")
    assert rx.recv() == ["STATUS=recovering: cuda_oom at 8"]  # one line, always
    assert notifier.stopping()
    assert rx.recv() == ["STOPPING=1"]


def test_abstract_namespace() -> None:
    name = f"oomguard-test-{os.getpid()}"
    rx = Receiver(b"\0" + name.encode())
    try:
        assert SystemdNotifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert rx.recv() == ["READY=1"]
    finally:
        rx.sock.close()


def test_no_socket_is_a_noop() -> None:
    notifier = SystemdNotifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready("x") and not notifier.status("x") and not notifier.stopping()
    watchdog = Watchdog.from_env(notifier, {"WATCHDOG_USEC": "1000000"})
    assert not watchdog.enabled and not watchdog.tick()


def test_socket_gone_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier(str(tmp_path / "missing.sock"))
    assert not notifier.status("a") and not notifier.status("b")
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1  # warned once


def test_watchdog_at_half_interval(receiver: tuple[Receiver, str]) -> None:
    rx, path = receiver
    now = [100.0]
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}
    watchdog = Watchdog.from_env(SystemdNotifier.from_env(env), env, clock=lambda: now[0])
    assert watchdog.interval_s == 1.0
    sent = []
    for t in (100.0, 100.4, 100.99, 101.0, 101.5, 102.2, 102.3):
        now[0] = t
        sent.append(watchdog.tick())
    assert sent == [True, False, False, True, False, True, False]
    assert [rx.recv() for _ in range(3)] == [["WATCHDOG=1"]] * 3
    assert not rx.pending()


def test_watchdog_with_the_real_clock(receiver: tuple[Receiver, str]) -> None:
    rx, path = receiver
    # A ping every 60 s: the second tick is not due however slowly a loaded machine gets to it
    # (the exact schedule is pinned with a scripted clock above).
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "120000000"}
    watchdog = Watchdog.from_env(SystemdNotifier.from_env(env), env)
    assert watchdog.interval_s == 60.0
    assert watchdog.tick() and not watchdog.tick()
    assert rx.recv() == ["WATCHDOG=1"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "junk"}, None),
        ({}, None),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}, 2.0),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected

ESC = "\x1b"
GIB = 1024**3
SNAPSHOT = {
    "state": "running",
    "attempt": 2,
    "micro_batch": 8,
    "grad_accum": 4,
    "world_size": 1,
    "gpu_bytes": 37 * GIB,
    "gpu_total_bytes": 80 * GIB,
    "host_bytes": 12 * GIB,
    "step": 1200,
    "total_steps": 5000,
    "samples_per_s": 512.34,
}

# A worker that the status line runs beside: colours, tabs, a progress bar, a long line.
DEMO = """
import sys, time
from oomguard.supervisor.ops.hooks import StatusLine
line = StatusLine()
line.update({"state": "starting", "attempt": 1, "micro_batch": 8, "grad_accum": 4, "world_size": 2})
for i in range(12):
    line.print_worker_line(f"worker output {i:02d} \\x1b[32mgreen\\x1b[0m\\tloss=0.{i}")
    line.update({"state": "running", "step": i * 10, "total_steps": 200, "samples_per_s": 100.0 + i})
    time.sleep(float(sys.argv[1]))
line.log("cuda_oom at micro-batch 8; restarting at 4 x 8")
line.close()
print("DONE", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 45, 725, 11220, 187200)] == [
        "0s",
        "45s",
        "12m05s",
        "3h07m",
        "2d04h",
    ]


def test_status_parts() -> None:
    text = " | ".join(part for part, _ in status_parts(SNAPSHOT, 3725.0))
    assert text == (
        "running | attempt 2 | 8 × 4 = 32 | GPU 37.0/80.0 GiB  host 12.0 GiB | step 1200/5000 | "
        "512.3 samples/s | ETA 1h02m"
    )
    multi = dict(SNAPSHOT, world_size=4)
    assert "8 x 4 x 4 = 128" in [part for part, _ in status_parts(multi, None, "x")]
    assert [part for part, _ in status_parts({}, None)] == ["starting"]


def test_eta_from_step_rate() -> None:
    now = [0.0]
    eta = EtaEstimator(clock=lambda: now[0], smoothing=1.0)
    assert eta.observe(100, 1100) is None  # no rate yet
    now[0] = 10.0
    assert eta.observe(200, 1100) == pytest.approx(90.0)  # 10 steps/s, 900 left
    now[0] = 20.0
    assert eta.observe(50, 1100) is None  # resumed from an older checkpoint: rate unknown again
    assert eta.observe(60, None) is None


def test_plain_mode_passes_worker_lines_untouched_and_logs_changes() -> None:
    now = [0.0]
    out = io.StringIO()
    line = StatusLine(out, terminal=False, plain_interval_s=60.0, clock=lambda: now[0])
    raw = "step 1 \x1b[31mred\x1b[0m\ttab  100% [#####     ]\r"
    line.update({"state": "running", "attempt": 1, "micro_batch": 8, "grad_accum": 4})
    line.print_worker_line(raw + "\n")
    for step in range(5):  # progress alone: no new line within the interval
        now[0] += 1
        line.update({"step": step})
    line.update({"state": "recovering"})  # a state change: logged at once
    now[0] += 61
    line.update({"step": 99})  # the interval passed: logged
    line.close()
    lines = out.getvalue().split("\n")
    assert lines[1] == raw  # byte for byte, our side added nothing
    assert lines[0] == "oomguard: running | attempt 1 | 8 x 4 = 32"
    assert lines[2].startswith("oomguard: recovering")
    assert lines[3].endswith("step 99")
    assert lines[4].endswith("step 99") and lines[5] == ""  # close() logs the final status
    assert ESC not in "".join(lines[:1] + lines[2:])  # no colour, no cursor movement of ours


def test_pipe_output_has_no_escape_codes(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    script.write_text(DEMO)
    result = subprocess.run(
        [sys.executable, str(script), "0", "0"], capture_output=True, text=True, timeout=30, check=True
    )
    ours = [line for line in result.stdout.splitlines() if not line.startswith("worker output")]
    assert all(ESC not in line for line in ours)
    workers = [line for line in result.stdout.splitlines() if line.startswith("worker output")]
    assert workers[3] == "worker output 03 \x1b[32mgreen\x1b[0m\tloss=0.3"
    assert len(workers) == 12


def test_real_pty_redraws_one_line(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    script.write_text(DEMO)
    primary, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": "150", "LINES": "40", "TERM": "xterm-256color"}
    proc = subprocess.Popen(
        [sys.executable, str(script), "0.01", "0"], stdout=secondary, stderr=secondary, env=env
    )
    os.close(secondary)
    output = _read_all(primary, proc)
    assert "\x1b[2K" in output or "\x1b[1A" in output  # the live line is erased and redrawn
    assert output.count("worker output 07") == 1
    assert "8 × 4 × 2 = 64" in output
    assert "\x1b[32mgreen" in output  # the worker's colour reaches the terminal


def _read_all(fd: int, proc: subprocess.Popen[bytes]) -> str:
    chunks = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=10)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_tmux_pane_shows_updating_status_beneath_intact_output(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    script.write_text(DEMO)
    server = f"oomguard-test-{os.getpid()}"
    tmux = ["tmux", "-L", server, "-f", "/dev/null"]
    command = f"{sys.executable} {script} 0.25 30"
    subprocess.run([*tmux, "new-session", "-d", "-s", "t", "-x", "160", "-y", "40", command], check=True)
    try:
        early = _wait_for_pane(tmux, r"step 20/200")
        final = _wait_for_pane(tmux, r"^DONE$")
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    assert _status_lines(early)[-1] == _last_nonblank(early)  # the status sits beneath the output
    assert (
        "step 110/200" in _status_lines(final)[0] and len(_status_lines(final)) == 1
    )  # updated, not repeated
    workers = [line for line in final.splitlines() if line.startswith("worker output")]
    # Exactly what the terminal shows for the raw line (tab stops every 8 columns).
    assert workers == [f"worker output {i:02d} green\tloss=0.{i}".expandtabs() for i in range(12)]
    assert "oomguard: cuda_oom at micro-batch 8; restarting at 4 x 8" in final


def _wait_for_pane(tmux: list[str], pattern: str) -> str:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", "t"], capture_output=True, text=True).stdout
        if re.search(pattern, pane, re.M):
            return pane
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} never appeared in the pane:\n{pane}")


def _status_lines(pane: str) -> list[str]:
    return [line for line in pane.splitlines() if "samples/s" in line]


def _last_nonblank(pane: str) -> str:
    return [line for line in pane.splitlines() if line.strip()][-1]
