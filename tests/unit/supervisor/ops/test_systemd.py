"""The generated systemd units: content, systemd's quoting, `systemd-analyze verify`, the command."""

from __future__ import annotations

import argparse
import io
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.supervisor import lifecycle as exits
from oomguard.supervisor.ops import systemd
from oomguard.supervisor.ops.systemd import ServiceError, UnitOptions, render_unit

STEERED = "import os\nmicro = int(os.environ[\"OOMGUARD_MICRO_BATCH\"])\n"  # a script oomguard can steer

NASTY_ARGS = [
    "--resume-args",
    "--resume-from {checkpoint} --lr 3e-4",
    "100%",
    "%n%i",
    "$HOME",
    "${USER}",
    "$$",
    'say "hi"',
    "it's",
    "back\\slash",
    "ends-with-backslash\\",
    ";",
    "a;b",
    "",
    "tab\there",
    "new\nline",
    "ünïcødé ✓",
    "-",
    "#not-a-comment",
    "  leading and trailing  ",
]

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


@pytest.fixture
def oomguard_bin(tmp_path: Path) -> Path:
    """A real executable for ExecStart (verify checks that the program exists)."""
    path = tmp_path / "bin" / "oomguard"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def _verify(unit_text: str, directory: Path, name: str = "oomguard-test.service", user: bool = False) -> str:
    """Run systemd-analyze verify; return the diagnostics about this unit file (empty when clean)."""
    unit = directory / name
    unit.write_text(unit_text)
    cmd = ["systemd-analyze", *(["--user"] if user else []), "verify", "--man=no", str(unit)]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(directory), "SYSTEMD_LOG_COLOR": "0"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    ours = [
        line for line in (result.stdout + result.stderr).splitlines() if name in line or str(unit) in line
    ]
    assert result.returncode == 0 or ours, result.stderr  # a failure must be about our unit
    return "\n".join(ours)


def _split_exec(value: str) -> list[str]:
    """systemd's reading of an ExecStart= value, as systemd.service(5) describes it, for our output.

    Order as in systemd: specifiers first (%% -> %), then splitting with quotes and C escapes,
    then environment expansion ($$ -> $).
    """
    text = value.replace("%%", "\0pct")
    assert "%" not in text, f"unescaped specifier in {value!r}"
    text = text.replace("\0pct", "%")
    words, i = [], 0
    while i < len(text):
        if text[i] == " ":
            i += 1
        elif text[i] == '"':
            word, i = _read_quoted(text, i + 1)
            words.append(word)
        else:
            end = text.find(" ", i)
            end = len(text) if end < 0 else end
            words.append(text[i:end])
            i = end
    return [word.replace("$$", "\0dollar").replace("\0dollar", "$") for word in words]


def _read_quoted(text: str, i: int) -> tuple[str, int]:
    escapes = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}
    out = []
    while text[i] != '"':
        if text[i] == "\\":
            if text[i + 1] == "x":
                out.append(chr(int(text[i + 2 : i + 4], 16)))
                i += 4
                continue
            out.append(escapes[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    assert i + 1 == len(text) or text[i + 1] == " ", "a closing quote must end the word"
    return "".join(out), i + 1


def _setting(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(key + "=")]


def test_unit_has_what_a_long_training_job_needs(oomguard_bin: Path, tmp_path: Path) -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/x"}
    argv = [
        str(oomguard_bin),
        "run",
        "--micro-batch",
        "8",
        "--global-batch",
        "64",
        "--",
        "python",
        "train.py",
    ]
    unit = render_unit(argv, tmp_path, env, "user", "oomguard-gpt")
    assert _setting(unit, "Restart") == ["on-failure"]
    assert _setting(unit, "OOMPolicy") == ["continue"]
    assert _setting(unit, "KillMode") == ["mixed"]
    assert int(_setting(unit, "TimeoutStopSec")[0]) >= 600
    assert _setting(unit, "WorkingDirectory") == [str(tmp_path)]
    assert _setting(unit, "WantedBy") == ["default.target"]
    environment = _setting(unit, "Environment")
    assert '"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"' in environment
    assert '"CUDA_VISIBLE_DEVICES=0,1"' in environment
    assert not any("HOME=" in item for item in environment)  # only what the job needs
    assert _split_exec(_setting(unit, "ExecStart")[0]) == argv


def test_environment_left_out_when_unset(oomguard_bin: Path, tmp_path: Path) -> None:
    unit = render_unit([str(oomguard_bin), "run"], tmp_path, {}, "user", "x")
    assert not any("CUDA" in item for item in _setting(unit, "Environment"))


@needs_systemd
@pytest.mark.parametrize("scope", ["user", "system"])
def test_verify_passes_cleanly_with_hostile_arguments(oomguard_bin: Path, tmp_path: Path, scope: str) -> None:
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128",
        "PATH": "/usr/bin:/bin",
        "CUDA_VISIBLE_DEVICES": "1",
    }
    argv = [str(oomguard_bin), "run", *NASTY_ARGS, "--", "python", "train.py", "--tag", "100%"]
    unit = render_unit(argv, tmp_path, env, scope, "oomguard-test", UnitOptions(user="alice"))
    assert _verify(unit, tmp_path, user=scope == "user") == ""
    assert _split_exec(_setting(unit, "ExecStart")[0]) == argv


@needs_systemd
def test_verify_has_teeth(oomguard_bin: Path, tmp_path: Path) -> None:
    """The same check flags an unescaped specifier and a missing program, so a clean pass means something."""
    unit = render_unit([str(oomguard_bin), "run", "100%"], tmp_path, {}, "system", "oomguard-test")
    assert "100%%" in unit
    assert "specifier" in _verify(unit.replace("100%%", "100%z"), tmp_path)
    missing = unit.replace(str(oomguard_bin), str(tmp_path / "nope"))
    assert _verify(missing, tmp_path) != ""


@needs_systemd
def test_working_directory_with_space_and_percent(oomguard_bin: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "my runs 100%"
    cwd.mkdir()
    unit = render_unit([str(oomguard_bin), "run"], cwd, {}, "system", "oomguard-test")
    assert _setting(unit, "WorkingDirectory") == [str(cwd).replace("%", "%%")]
    assert _verify(unit, tmp_path) == ""


def test_system_scope_runs_as_the_user_after_the_network(oomguard_bin: Path, tmp_path: Path) -> None:
    unit = render_unit([str(oomguard_bin), "run"], tmp_path, {}, "system", "x", UnitOptions(user="alice"))
    assert _setting(unit, "User") == ["alice"]
    assert _setting(unit, "WantedBy") == ["multi-user.target"]
    assert _setting(unit, "After") == ["network-online.target"]


@pytest.mark.parametrize(
    ("argv", "scope", "name", "needle"),
    [
        (["oomguard", "run"], "user", "x", "absolute path"),
        ([], "user", "x", "empty"),
        (["/bin/true", "run"], "global", "x", "scope"),
        (["/bin/true", "run"], "user", "bad name!", "--name"),
        (["/bin/true", "a\0b"], "user", "x", "NUL"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], scope: str, name: str, needle: str, tmp_path: Path) -> None:
    with pytest.raises(ServiceError) as caught:
        render_unit(argv, tmp_path, {}, scope, name)
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oomguard")
    systemd.add_service_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["service", *argv])


def test_command_writes_the_unit_atomically_and_prints_next_steps(
    oomguard_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, work = tmp_path / "config", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.chdir(work)
    (work / "t.py").write_text(STEERED)
    args = _parse(
        "--name",
        "gpt",
        "--exec",
        str(oomguard_bin),
        "--",
        "run",
        "--micro-batch",
        "8",
        "--grad-accum",
        "1",
        "--",
        sys.executable,
        "t.py",
    )
    out = io.StringIO()
    assert systemd.run_service_command(args, out) == 0
    unit_path = config / "systemd" / "user" / "gpt.service"
    text = unit_path.read_text()
    argv = _split_exec(_setting(text, "ExecStart")[0])
    assert argv == [str(oomguard_bin), "run", "--micro-batch", "8", "--grad-accum", "1", "--", sys.executable, "t.py"]
    assert '"CUDA_VISIBLE_DEVICES=3"' in _setting(text, "Environment")
    assert [p.name for p in unit_path.parent.iterdir()] == ["gpt.service"]  # no temp file left
    printed = out.getvalue()
    assert "systemctl --user enable --now gpt.service" in printed
    assert "loginctl enable-linger" in printed


def test_print_writes_nothing(oomguard_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(STEERED)
    out = io.StringIO()
    args = _parse("--print", "--exec", str(oomguard_bin), "--", "--micro-batch", "4", "--grad-accum", "1", "--",
                  sys.executable, "t.py")
    assert systemd.run_service_command(args, out) == 0
    assert out.getvalue().startswith("# Generated by `oomguard service`")
    assert re.search(rf"^ExecStart={re.escape(str(oomguard_bin))} run --micro-batch 4 ", out.getvalue(), re.M)
    assert not (tmp_path / "config").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--name", "a/b", "--", "--micro-batch", "4"], "--name"), (["--"], "no run arguments"),
     # what oomguard run would refuse at start is refused before a unit is written
     (["--", "--micro-bach", "32", "--", sys.executable, "t.py"], "--micro-bach 32 (did you mean --micro-batch?)"),
     (["--", "--micro-batch", "8", "--grad-accum", "1", sys.executable, "t.py"], "put -- before the training command"),
     (["--", "--micro-batch", "8", "--grad-accum", "1", "--", sys.executable, "trian.py"], "trian.py does not exist"),
     (["--user", "nobody", "--", "--micro-batch", "8", "--grad-accum", "1", "--", sys.executable, "t.py"],
      "--user nobody needs --system"),
     (["--", "--micro-batch", "8", "--grad-accum", "1", "--checkpoint", "out/*.pt", "--", sys.executable, "t.py"],
      "nothing hands the checkpoint to the script")],
)
def test_command_bad_input_exits_2(
    argv: list[str], needle: str, oomguard_bin: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(STEERED)
    assert systemd.run_service_command(_parse("--print", "--exec", str(oomguard_bin), *argv)) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""  # no unit printed


def test_wired_into_the_oomguard_cli(
    oomguard_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through cli.main, which splits argv at the first -- itself."""
    from oomguard.supervisor import cli

    monkeypatch.setattr(cli, "EXTRA_COMMANDS", [systemd.add_service_command])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(STEERED)
    argv = [
        "service",
        "--print",
        "--exec",
        str(oomguard_bin),
        "--",
        "--micro-batch",
        "8",
        "--grad-accum",
        "1",
        "--",
        sys.executable,
        "t.py",
    ]
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert cli.main(argv) == 0
    exec_start = _split_exec(_setting(out.getvalue(), "ExecStart")[0])
    assert exec_start == [str(oomguard_bin), "run", "--micro-batch", "8", "--grad-accum", "1", "--", sys.executable,
                          "t.py"]


# --- What systemd does when oomguard ends (tests/e2e/test_systemd_pid1.py shows it under a real systemd) --------


def test_a_stop_is_a_success_and_a_give_up_is_not_restarted(oomguard_bin: Path, tmp_path: Path) -> None:
    unit = render_unit([str(oomguard_bin), "run"], tmp_path, {}, "user", "x")
    assert _setting(unit, "SuccessExitStatus") == ["130 143"]  # 128 + SIGINT, 128 + SIGTERM: the loop's stop
    prevented = set(_setting(unit, "RestartPreventExitStatus")[0].split())
    assert prevented == {"1", "2", "3"}  # gave up, bad usage, an error no restart can fix
    # restarted: oomguard's own crash and a lost peer node (EX_TEMPFAIL: the run goes on once it is back)
    assert str(exits.EXIT_CRASHED) not in prevented and str(exits.EXIT_PEER_LOST) not in prevented


def test_exit_statuses_are_the_ones_oomguard_returns() -> None:
    from oomguard.supervisor.distributed import coordination
    from oomguard.supervisor.run.runparts import ControlFlags

    assert coordination.EXIT_PEER_LOST == exits.EXIT_PEER_LOST
    flags = ControlFlags()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    try:
        flags.install_signal_handlers()
        stop_signals = {sig for sig in saved if signal.getsignal(sig) == flags._on_stop_signal}
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert {128 + sig for sig in stop_signals} == set(exits.STOPPED)  # the loop's _stopped: 128 + the signal


def test_an_unexpected_error_in_oomguard_is_exit_70_not_the_give_up_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from oomguard.supervisor import cli

    def broken(args: argparse.Namespace, command: object) -> int:
        raise RuntimeError("a bug in oomguard")

    monkeypatch.setattr(cli, "_cmd_status", broken)
    assert cli.main(["status"]) == exits.EXIT_CRASHED
    assert "RuntimeError: a bug in oomguard" in capsys.readouterr().err  # the traceback, for the bug report


def test_path_is_passed_once_in_its_order(oomguard_bin: Path, tmp_path: Path) -> None:
    env = {"PATH": "/venv/bin:/usr/bin::/home/a/.local/bin:/venv/bin:/usr/bin:/bin:"}
    unit = render_unit([str(oomguard_bin), "run"], tmp_path, env, "user", "x")
    assert '"PATH=/venv/bin:/usr/bin:/home/a/.local/bin:/bin"' in _setting(unit, "Environment")


def test_watchdog_option_sets_watchdogsec(oomguard_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    run = ["--", "--micro-batch", "4", "--grad-accum", "1", "--", sys.executable, "t.py", "--bs", "{micro_batch}"]
    for flag, expected in (("20", ["20"]), ("0", [])):
        out = io.StringIO()
        assert systemd.run_service_command(_parse("--print", "--exec", str(oomguard_bin), "--watchdog", flag, *run),
                                           out) == 0
        assert _setting(out.getvalue(), "WatchdogSec") == expected
    assert systemd.run_service_command(_parse("--print", "--exec", str(oomguard_bin), "--watchdog", "-1", *run)) == 2


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="checking as another user needs root")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every user may search (pytest's tmp_path sits below a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="oomguard-service-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _system_unit_for(user: str, work: Path, oomguard_bin: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.chdir(work)
    (work / "t.py").write_text("")
    args = _parse("--print", "--system", "--user", user, "--exec", str(oomguard_bin), "--", "--micro-batch", "4",
                  "--grad-accum", "1", "--", sys.executable, "t.py", "--batch-size", "{micro_batch}")
    return systemd.run_service_command(args, io.StringIO())


@needs_root
def test_a_user_who_cannot_write_the_directory_is_refused_with_the_fix(
    oomguard_bin: Path, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = shared_tmp / "project"
    work.mkdir()  # root's, 0755: nobody may enter but not write
    assert _system_unit_for("nobody", work, oomguard_bin, monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"--user nobody cannot write {work}: give it to that user (sudo chown -R nobody: {work})" in err
    assert err.count("\n") == 1

    os.chown(work, pwd.getpwnam("nobody").pw_uid, -1)
    assert _system_unit_for("nobody", work, oomguard_bin, monkeypatch) == 0
    run_dir = work / "oomguard-run"  # a run root started here before: its journal is root's
    run_dir.mkdir()
    os.chown(run_dir, pwd.getpwnam("nobody").pw_uid, -1)
    (run_dir / "journal.sqlite").write_text("")
    assert _system_unit_for("nobody", work, oomguard_bin, monkeypatch) == 2
    assert f"cannot write {run_dir / 'journal.sqlite'}" in capsys.readouterr().err
    assert _system_unit_for("no-such-user-here", work, oomguard_bin, monkeypatch) == 2
    assert "--user no-such-user-here: no such account" in capsys.readouterr().err


def test_without_root_the_mode_bits_decide(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    account = pwd.struct_passwd(("alice", "x", 54321, 54321, "", "/home/alice", "/bin/sh"))
    monkeypatch.setattr(os, "getgrouplist", lambda name, gid: [gid])
    mine, theirs = shared_tmp / "mine", shared_tmp / "theirs"
    mine.mkdir(mode=0o777)
    mine.chmod(0o777)
    theirs.mkdir(mode=0o755)
    assert systemd._denied(account, [mine]) is None
    assert systemd._denied(account, [mine, theirs]) == theirs
    shared_tmp.chmod(0o700)  # a parent alice cannot search
    assert systemd._denied(account, [mine]) == mine
