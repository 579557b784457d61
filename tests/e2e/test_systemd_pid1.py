"""The unit `oomguard service` writes, run by a real systemd as PID 1 in a podman container.

One container per module (tests/containers.py makes the Debian base and the systemd image, both cached);
each test writes its own unit with `oomguard service --system` inside it and drives it with systemctl:

* start: active once the supervisor sent READY=1, with its status line in StatusText;
* stop: inactive (not failed), the worker's final checkpoint written, the worker stopped by oomguard
  (systemd killed nothing), no process of the job left;
* a give-up (crash loop): exit 1, failed, and systemd does not restart it (NRestarts=0);
* oomguard killed with SIGKILL: systemd restarts it and the run goes on from its journal (attempt 2);
  then, stopped with SIGSTOP (alive but silent), systemd's watchdog aborts it and starts attempt 3.

The job is plain Python (no torch): a step every 0.1 s, a checkpoint every 5 steps, a last one on SIGTERM.
Where podman or systemd cannot run here, the tests skip with the error they met.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import containers
import pytest

from oomguard.supervisor import lifecycle as exits

ROOT = Path(__file__).resolve().parents[2]
JOBS = "/srv/jobs"  # the test's tmp directory, mounted read-write: the host reads the checkpoints there
JOB = """\
import argparse, os, signal, sys, time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--micro", type=int, required=True)
parser.add_argument("--accum", type=int, required=True)
parser.add_argument("--resume", type=Path)
parser.add_argument("--crash-at", type=int, default=0)
args = parser.parse_args()
attempt = os.environ["OOMGUARD_ATTEMPT"]
step = int(args.resume.read_text().split()[0]) if args.resume else 0
ckpt = Path("ckpt")
ckpt.mkdir(exist_ok=True)


def save(kind):
    tmp = ckpt / f".step-{step}.tmp"
    tmp.write_text(f"{step} {kind} attempt={attempt}\\n")
    os.replace(tmp, ckpt / f"step-{step}.txt")


def on_term(signum, frame):
    save("final")
    print(f"final checkpoint at step {step}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
print(f"attempt {attempt} at micro-batch {args.micro} from step {step}", flush=True)
while True:
    time.sleep(0.1)
    step += 1
    print(f"step {step}", flush=True)
    if step % 5 == 0:
        save("periodic")
    if args.crash_at and step >= args.crash_at:
        raise RuntimeError("the job crashed")
"""
# The job's processes (``python3 .../job.py``; not oomguard nor its launcher, which name it later in their
# command lines), listed from inside the container.
FIND_JOB = """
import os
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    if len(argv) > 1 and argv[1].endswith(b"/job.py"):
        print(pid, b" ".join(argv).decode())
"""


@dataclass
class Box:
    """The running container: systemd is its PID 1."""

    name: str
    jobs: Path  # the host side of JOBS

    def sh(self, command: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = containers.podman("exec", self.name, "sh", "-c", command, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{command} -> {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, unit: str, what: str, ok: dict[str, str], timeout: float = 120) -> dict[str, str]:
        deadline, props = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            props = self.show(unit, *ok, "ActiveState", "SubState", "NRestarts", "MainPID", "ExecMainStatus")
            if all(props.get(k) == v for k, v in ok.items()):
                return props
            time.sleep(0.5)
        raise AssertionError(f"{unit}: {what} never came: {props}\n{self.journal(unit)}")

    def journal(self, unit: str) -> str:
        return self.sh(f"journalctl --no-pager -o cat -u {unit}", check=False).stdout[-6000:]

    def uid(self, user: str) -> int:
        return int(self.sh(f"id -u {user}").stdout)

    def job_processes(self) -> str:
        return self.sh(f"python3 -c {shlex.quote(FIND_JOB)}").stdout.strip()


def _boot(image: str, jobs: Path) -> tuple[str, str | None]:
    """Start systemd in a container; (name, why it did not come up or None)."""
    name = f"oomguard-systemd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    started = containers.podman(
        "run", "--detach", "--name", name, "--systemd=always", "--network", "none", *containers.ulimits(),
        "--volume", f"{ROOT / 'oomguard'}:{containers.SYSTEMD_SOURCE}/oomguard:ro", "--volume", f"{jobs}:{JOBS}",
        image, "/lib/systemd/systemd", timeout=120)
    if started.returncode != 0:
        return name, f"podman cannot start systemd in a container here: {started.stderr.strip()[-500:]}"
    deadline, state = time.monotonic() + 120, ""
    while time.monotonic() < deadline:
        done = containers.podman("exec", name, "systemctl", "is-system-running", timeout=60)
        state = done.stdout.strip() or done.stderr.strip()
        if state in ("running", "degraded"):
            return name, None
        if containers.podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip() != "true":
            break
        time.sleep(0.5)
    logs = containers.podman("logs", name)
    return name, f"systemd did not come up as PID 1 ({state}): {(logs.stdout + logs.stderr).strip()[-800:]}"


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    reason = containers.unavailable()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    with containers.locked():
        base = containers.base_image()
        image, build_s = containers.systemd_image(ROOT, base)
    jobs = tmp_path_factory.mktemp("jobs")
    jobs.chmod(0o755)
    (jobs / "job.py").write_text(JOB)
    name, reason = _boot(image, jobs)
    try:
        if reason:
            pytest.skip(reason)
        print(f"\nsystemd image {image} ready (built in {build_s:.1f} s), booted in "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr)
        yield Box(name, jobs)
    finally:
        containers.podman("rm", "--force", "--time", "5", name, timeout=120)


@pytest.fixture
def unit(box: Box, request: pytest.FixtureRequest) -> Iterator[str]:
    """A unit name for this test; whatever the test left running is stopped after it."""
    name = "og-" + request.node.name.removeprefix("test_")[:40].replace("_", "-")
    yield name
    box.sh(f"systemctl stop {name}; systemctl reset-failed {name}", check=False)


def _install(box: Box, unit: str, *job_args: str, watchdog: int = 120, stop_timeout: int = 60,
             user: str | None = None, **run: str) -> Path:
    """`oomguard service --system` for the job, in its own directory (given to ``user`` when set, who then
    runs it), then daemon-reload. systemd's restart delay is cut to 1 s with a drop-in (the unit's own 30 s
    would only slow the test)."""
    workdir = box.jobs / unit
    workdir.mkdir()
    if user is not None:
        box.sh(f"chown {user}: {JOBS}/{unit}")
    options = {"--micro-batch": "8", "--grad-accum": "1", "--backoff": "0.1", "--grace-period": "20",
               "--checkpoint": "ckpt/step-*.txt", "--resume-args": "--resume {checkpoint}", **run}
    run_args = [word for pair in options.items() for word in pair]
    command = [containers.SYSTEMD_OOMGUARD, "service", "--system", *(["--user", user] if user else []),
               "--name", unit, "--stop-timeout", str(stop_timeout),
               "--watchdog", str(watchdog), "--", *run_args, "--",
               "python3", f"{JOBS}/job.py", "--micro", "{micro_batch}", "--accum", "{grad_accum}", *job_args]
    box.sh(f"cd {JOBS}/{unit} && {shlex.join(command)}")
    box.sh(f"mkdir -p /etc/systemd/system/{unit}.service.d && "
           f"printf '[Service]\\nRestartSec=1\\n' > /etc/systemd/system/{unit}.service.d/test.conf && "
           "systemctl daemon-reload")
    return workdir


def _steps(workdir: Path, at_least: int, timeout: float = 120) -> None:
    """Wait until the job has checkpointed step ``at_least`` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(int(p.stem.split("-")[1]) >= at_least for p in (workdir / "ckpt").glob("step-*.txt")):
            return
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {at_least} in {workdir}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_start_is_ready_with_status_and_stop_is_clean(box: Box, unit: str) -> None:
    workdir = _install(box, unit)
    started = time.monotonic()
    box.sh(f"systemctl start {unit}", timeout=300)  # Type=notify: returns once READY=1 came
    props = box.show(unit, "ActiveState", "SubState", "StatusText", "MainPID")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), box.journal(unit)
    assert props["StatusText"].startswith("running, attempt 1, micro-batch 8 × 1"), props
    _steps(workdir, 5)
    assert box.job_processes(), "the worker is not running"

    box.sh(f"systemctl stop {unit}", timeout=120)  # waits for the supervisor to exit
    log = box.journal(unit)
    print(f"\nstart, 5 steps, stop under systemd: {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert box.show(unit, "ActiveState")["ActiveState"] == "inactive", log
    # An inactive unit is unloaded, and `systemctl show` then reads it afresh: its journal tells how it ended.
    # Without SuccessExitStatus=143 this says "Main process exited, code=exited, status=143/n/a" and
    # "Failed with result 'exit-code'".
    assert "stopped: stopped by SIGTERM" in log and "Deactivated successfully" in log, log
    assert "status=143" not in log and "Failed with result" not in log, log
    finals = [p for p in (workdir / "ckpt").glob("step-*.txt") if "final" in p.read_text()]
    assert finals, f"no final checkpoint\n{log}"
    assert "final checkpoint at step" in log
    assert box.job_processes() == "", "a process of the job outlived the unit"
    # oomguard stopped its worker itself: systemd had nothing left to kill
    assert "Killing process" not in log and "remains running" not in log, log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_give_up_is_not_restarted(box: Box, unit: str) -> None:
    # As another account (User=nobody). In a directory it cannot write, no unit is written: one line, exit 2.
    refused = box.sh(f"cd {JOBS} && {containers.SYSTEMD_OOMGUARD} service --print --system --user nobody -- "
                     f"--micro-batch 8 --grad-accum 1 -- python3 {JOBS}/job.py --micro {{micro_batch}}", check=False)
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr == (f"oomguard service: error: --user nobody cannot write {JOBS}: give it to that user "
                              f"(sudo chown -R nobody: {JOBS}), or run `oomguard service` in a directory nobody can "
                              "write\n"), refused.stderr
    workdir = _install(box, unit, "--crash-at", "2", user="nobody", **{"--max-restarts": "1"})
    box.sh(f"systemctl start {unit}", timeout=300, check=False)  # may fail: the give-up can come before READY
    props = box.wait_for(unit, "the give-up", {"ActiveState": "failed"})
    assert props["ExecMainStatus"] == str(exits.EXIT_GAVE_UP), f"{props}\n{box.journal(unit)}"
    time.sleep(3)  # RestartSec is 1 s here: a restart would have come
    props = box.show(unit, "ActiveState", "NRestarts")
    assert props == {"ActiveState": "failed", "NRestarts": "0"}, f"{props}\n{box.journal(unit)}"
    assert box.job_processes() == ""
    assert (workdir / "oomguard-run" / "journal.sqlite").stat().st_uid == box.uid("nobody")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_or_hung_supervisor_is_restarted_and_continues_its_run(box: Box, unit: str) -> None:
    # TimeoutStopSec also bounds systemd's wait for the cgroup to empty after its SIGKILL: systemd in a container
    # on cgroup v1 is not always told that the cgroup emptied (no release agent there) and then waits it out.
    workdir = _install(box, unit, watchdog=6, stop_timeout=10, **{"--grace-period": "5"})
    box.sh(f"systemctl start {unit}", timeout=300)
    _steps(workdir, 5)
    first = box.show(unit, "MainPID")["MainPID"]
    box.sh(f"kill -KILL {first}")
    second = box.wait_for(unit, "a restart after SIGKILL", {"ActiveState": "active", "NRestarts": "1"})["MainPID"]
    assert second != first
    log = box.journal(unit)
    assert "continuing run in" in log and "(attempt 1 so far)" in log, log
    resumed = re.search(r"^attempt 2 at micro-batch 8 from step (\d+)$", log, re.M)
    assert resumed and int(resumed.group(1)) >= 5, log  # from the newest checkpoint, not from the start
    assert len(box.job_processes().splitlines()) == 1, "the first worker outlived its supervisor"

    time.sleep(7)  # longer than WatchdogSec: the supervisor's pings keep it alive
    assert box.show(unit, "NRestarts", "MainPID") == {"NRestarts": "1", "MainPID": second}, box.journal(unit)
    box.sh(f"kill -STOP {second}")  # alive, but silent
    third = box.wait_for(unit, "the watchdog's restart", {"ActiveState": "active", "NRestarts": "2"})["MainPID"]
    assert third != second
    log = box.journal(unit)
    assert "Watchdog timeout (limit 6s)" in log and "(attempt 2 so far)" in log, log
    assert re.search(r"^attempt 3 at micro-batch 8 from step \d+$", log, re.M), log
    box.sh(f"systemctl stop {unit}", timeout=120)
    assert box.show(unit, "ActiveState")["ActiveState"] == "inactive"
    assert box.job_processes() == ""
