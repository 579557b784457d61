"""A systemd unit for the user's exact ``oomguard run`` command: ``oomguard service``.

systemd's defaults suit short daemons, not a training job that runs overnight. The unit sets what
such a job needs: ``Restart=on-failure`` for the supervisor itself, ``OOMPolicy=continue`` (otherwise
one kernel OOM kill of the worker stops the whole unit, supervisor included), a ``TimeoutStopSec``
long enough for a final checkpoint, and ``KillMode=mixed`` so that systemd sends SIGTERM to the
supervisor alone and the supervisor stops its worker group itself (SIGKILL reaches all only at the
deadline). How ``oomguard run`` ends (lifecycle.py) decides what systemd does next: a stop is a
success, a give-up is not restarted, a crash of oomguard itself is. tests/e2e/test_systemd_pid1.py runs
the unit under a real systemd and shows each of these.

Arguments are quoted by systemd's rules (``systemd.service(5)``, "Command lines"), not the shell's:
each word is double-quoted with C escapes, ``%`` is a specifier (``%%``) and ``$`` an environment
reference (``$$``) in ``ExecStart=``.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from oomguard.supervisor import lifecycle as exits
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import write_atomic

USER = "user"
SYSTEM = "system"
SCOPES = (USER, SYSTEM)

# Passed from the caller's environment when set: the command must find the same python (PATH and the
# virtualenv), the same GPUs and the same allocator settings under systemd as in the user's shell.
PASSED_ENV = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")
# Worker output reaches journald line by line instead of in 8 KiB blocks.
FIXED_ENV = {"PYTHONUNBUFFERED": "1"}

_SAFE_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\-]+")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


class ServiceError(UsageError):
    """Bad input to ``oomguard service``; the message is one line naming the option and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)


@dataclass(frozen=True)
class UnitOptions:
    """The settings of a generated unit that are not the command itself."""

    stop_timeout_s: int = 900  # a large model's final checkpoint can take minutes
    restart_sec: int = 30
    start_limit_burst: int = 5
    start_limit_interval_s: int = 3600
    notify: bool = True  # Type=notify: the supervisor sends READY=1 (ops/hooks.py)
    watchdog_s: int = 120  # 0 disables WatchdogSec; the loop pings at half of it
    no_restart_exit_codes: tuple[int, ...] = exits.NO_RESTART  # give-ups: a restart cannot help
    success_exit_codes: tuple[int, ...] = exits.STOPPED  # the operator's stop is no failure
    user: str | None = None  # system scope: the account that runs the job

    def __post_init__(self) -> None:
        if self.stop_timeout_s < 1:
            raise ServiceError("--stop-timeout must be at least 1 second")
        if self.watchdog_s < 0:
            raise ServiceError("--watchdog must be 0 (off) or a number of seconds, e.g. --watchdog 120")


def unit_dir(scope: str, env: Mapping[str, str] = os.environ) -> Path:
    """Where systemd looks for units of this scope (user: ``~/.config/systemd/user``)."""
    _check_scope(scope)
    if scope == SYSTEM:
        return Path("/etc/systemd/system")
    config = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or str(Path.home()), ".config")
    return Path(config) / "systemd" / "user"


def unit_file_name(name: str) -> str:
    """``name`` with the ``.service`` suffix, after checking it is a valid unit name."""
    stem = name.removesuffix(".service")
    if not stem or not _UNIT_NAME.fullmatch(stem) or len(stem) > 240:
        raise ServiceError(f"--name {name!r} is not a valid unit name: use letters, digits and ':_.-' "
                           "(e.g. --name oomguard-gpt)")
    return stem + ".service"


def default_name(cwd: Path) -> str:
    """``oomguard-<directory>``, the directory name reduced to characters a unit name allows."""
    return "oomguard-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", cwd.name).strip("-.") or "run")


def quote_word(word: str) -> str:
    """One ``ExecStart=`` argument, quoted so systemd hands ``word`` to the program unchanged."""
    if "\0" in word:
        raise ServiceError("a command argument contains a NUL byte, which no process argument can hold")
    escaped = _escape_specifiers(word).replace("$", "$$")
    if _SAFE_WORD.fullmatch(word):
        return escaped
    return _c_quoted(escaped)


def quote_env(key: str, value: str) -> str:
    """One ``Environment=`` assignment; ``$`` has no meaning there, ``%`` is still a specifier."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ServiceError(f"environment variable name {key!r} is not valid in a unit")
    text = _escape_specifiers(f"{key}={value}")
    return _c_quoted(text)


def exec_line(argv: Sequence[str]) -> str:
    """The value of ``ExecStart=`` for ``argv``; the program must be an absolute path."""
    if not argv:
        raise ServiceError("the command is empty: give the oomguard run arguments after --")
    if not os.path.isabs(argv[0]):
        raise ServiceError(f"the program {argv[0]!r} must be an absolute path in ExecStart=")
    return " ".join(quote_word(word) for word in argv)


def render_unit(argv: list[str], cwd: Path, env: Mapping[str, str], scope: str, name: str,
                options: UnitOptions | None = None) -> str:
    """The text of a ``.service`` unit running ``argv`` (``[/abs/oomguard, run, ...]``) in ``cwd``."""
    _check_scope(scope)
    opts = options or UnitOptions()
    if not cwd.is_absolute() or "\n" in str(cwd):
        raise ServiceError(f"the working directory {str(cwd)!r} must be an absolute path on one line")
    stem = unit_file_name(name).removesuffix(".service")
    lines = [
        f"# Generated by `oomguard service` for: {_one_line(shlex.join(argv))}",
        f"# Working directory: {_one_line(str(cwd))}",
        "",
        *_unit_section(stem, scope, opts),
        "",
        *_service_section(argv, cwd, env, scope, stem, opts),
        "",
        "[Install]",
        f"WantedBy={'default.target' if scope == USER else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def _unit_section(stem: str, scope: str, opts: UnitOptions) -> list[str]:
    # Restart=on-failure is bounded: after this many restarts in the interval the unit stays failed.
    lines = ["[Unit]", f"Description=oomguard supervised training ({stem})",
             f"StartLimitIntervalSec={opts.start_limit_interval_s}", f"StartLimitBurst={opts.start_limit_burst}"]
    if scope == SYSTEM:  # webhooks need the network; the user manager has no network-online.target
        lines += ["Wants=network-online.target", "After=network-online.target"]
    return lines


def _service_section(argv: Sequence[str], cwd: Path, env: Mapping[str, str], scope: str, stem: str,
                     opts: UnitOptions) -> list[str]:
    lines = ["[Service]"]
    if opts.notify:
        # The supervisor sends READY=1 once the worker runs, and WATCHDOG=1 while its loop is healthy.
        lines += ["Type=notify", "NotifyAccess=main", "TimeoutStartSec=300"]
        if opts.watchdog_s:
            lines.append(f"WatchdogSec={opts.watchdog_s}")
    else:
        lines.append("Type=exec")
    if scope == SYSTEM and opts.user:
        lines.append(f"User={_escape_specifiers(opts.user)}")
    lines.append(f"WorkingDirectory={_escape_specifiers(str(cwd))}")
    lines += [f"Environment={quote_env(k, v)}" for k, v in _unit_env(env).items()]
    lines += [f"ExecStart={exec_line(argv)}", "Restart=on-failure", f"RestartSec={opts.restart_sec}"]
    if opts.no_restart_exit_codes:
        lines.append("RestartPreventExitStatus=" + " ".join(str(c) for c in opts.no_restart_exit_codes))
    if opts.success_exit_codes:
        lines.append("SuccessExitStatus=" + " ".join(str(c) for c in opts.success_exit_codes))
    lines += [
        # One kernel OOM kill of the worker must not take the supervisor down with it.
        "OOMPolicy=continue",
        # SIGTERM to the supervisor alone; it checkpoints and stops its worker group itself.
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={opts.stop_timeout_s}",
        f"SyslogIdentifier={stem}",
    ]
    return lines


def _unit_env(env: Mapping[str, str]) -> dict[str, str]:
    chosen = {key: env[key] for key in PASSED_ENV if env.get(key)}
    if "PATH" in chosen:
        chosen["PATH"] = search_path(chosen["PATH"])
    return {**chosen, **FIXED_ENV}


def search_path(path: str) -> str:
    """``PATH`` with each directory once, at its first place (a shell's rc files often prepend a
    venv or ~/.local/bin again on every nested shell); empty entries, which mean the working
    directory, are left out."""
    return os.pathsep.join(dict.fromkeys(entry for entry in path.split(os.pathsep) if entry))


def _escape_specifiers(text: str) -> str:
    return text.replace("%", "%%")


def _c_quoted(text: str) -> str:
    return '"' + "".join(_C_ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                         for ch in text) + '"'


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ServiceError(f"scope {scope!r} is unknown: use 'user' (default) or 'system' (--system)")


# ---------------------------------------------------------------------------------------------
# The command line


def find_oomguard() -> str:
    """The absolute path of the ``oomguard`` console script that systemd should start."""
    beside_python = Path(sys.executable).parent / "oomguard"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    if found := shutil.which("oomguard"):
        return os.path.abspath(found)
    raise ServiceError("the oomguard executable was not found: install oomguard (pip install oomguard) or pass "
                       "--exec PATH")


def run_args(raw: Sequence[str]) -> list[str]:
    """The ``oomguard run`` arguments given after ``--`` (a leading ``run`` is accepted too)."""
    args = list(raw)
    if args[:1] == ["--"]:
        args = args[1:]
    if args[:1] == ["run"]:
        args = args[1:]
    if not args:
        raise ServiceError("no run arguments: give them after --, e.g. "
                           "oomguard service -- --micro-batch 8 --global-batch 64 -- python train.py")
    return args


def add_service_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``oomguard service`` on the CLI's subparsers."""
    parser = subparsers.add_parser("service", help="write a systemd unit for an oomguard run command",
                                   description="Write (or print) a systemd unit that runs `oomguard run ARGS...` "
                                   "in this directory.")
    add = parser.add_argument
    add("--print", dest="print_only", action="store_true", help="print the unit, write nothing")
    add("--system", action="store_true", help="a system unit in /etc/systemd/system (needs root)")
    add("--name", default=None, help="unit name (default: oomguard-<directory>)")
    add("--user", dest="unit_user", default=None, help="with --system: the account to run as")
    add("--stop-timeout", type=int, default=UnitOptions.stop_timeout_s, help="seconds for a final checkpoint")
    add("--watchdog", type=int, default=UnitOptions.watchdog_s,
        help="WatchdogSec: restart a supervisor silent this long (0: off)")
    add("--exec", dest="executable", default=None, help="path of the oomguard executable")
    add("run_args", nargs=argparse.REMAINDER, help="-- then the arguments of oomguard run")
    parser.set_defaults(func=_cmd_service)


def _cmd_service(args: argparse.Namespace, command: Sequence[str]) -> int:
    # oomguard's main() splits argv at the first "--" and hands what follows over as ``command``.
    if command:
        args.run_args = ["--", *command]
    return run_service_command(args)


def run_service_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out ``oomguard service``; 0 on success, 2 (with a one-line error) on bad input."""
    stream = out if out is not None else sys.stdout
    try:
        text, path, scope, name = _prepare(args)
        if args.print_only:
            print(text, end="", file=stream)
            return 0
        _write_unit(path, text)
    except ServiceError as error:
        print(f"oomguard service: error: {error}", file=sys.stderr)
        return 2
    print(next_steps(path, scope, name), file=stream)
    return 0


def _prepare(args: argparse.Namespace) -> tuple[str, Path, str, str]:
    scope = SYSTEM if args.system else USER
    cwd = Path.cwd()
    name = unit_file_name(args.name or default_name(cwd))
    executable = os.path.abspath(args.executable) if args.executable else find_oomguard()
    argv = [executable, "run", *run_args(args.run_args)]
    run_dir = cwd / _check_run(argv[2:], cwd)
    options = UnitOptions(stop_timeout_s=args.stop_timeout, watchdog_s=args.watchdog, user=_unit_user(args, scope))
    if options.user is not None:
        check_writable(options.user, cwd, run_dir)
    text = render_unit(argv, cwd, os.environ, scope, name, options)
    return text, unit_dir(scope) / name, scope, name


def _check_run(args: Sequence[str], cwd: Path) -> Path:
    """What ``oomguard run`` would refuse at start is refused now: systemd would only find it when
    the unit starts (and restart it, and give up). Returns the run directory."""
    from oomguard.supervisor.run.preflight import check_run_args

    try:
        return check_run_args(args, cwd).run_dir
    except UsageError as error:
        raise ServiceError(str(error)) from None


def _unit_user(args: argparse.Namespace, scope: str) -> str | None:
    if scope != SYSTEM:
        if args.unit_user:
            raise ServiceError(f"--user {args.unit_user} needs --system: a user unit runs as you")
        return None
    user: str | None = args.unit_user or os.environ.get("SUDO_USER") or pwd.getpwuid(os.getuid()).pw_name
    return None if user == "root" else user


def check_writable(user: str, cwd: Path, run_dir: Path) -> None:
    """``User=user`` must be able to write the working directory (the worker's checkpoints) and the
    run directory with its journal; otherwise every start fails (exit 2, not restarted) and only
    ``journalctl`` says why. Checked as that user where we are root, from the mode bits elsewhere."""
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        raise ServiceError(f"--user {user}: no such account; create it or name an existing one") from None
    existing = run_dir if run_dir.exists() else run_dir.parent
    wanted = [cwd, existing, *(sorted(run_dir.iterdir()) if run_dir.is_dir() else [])]
    denied = _denied(account, list(dict.fromkeys(wanted)))
    if denied is not None:
        raise ServiceError(f"--user {user} cannot write {denied}: give it to that user (sudo chown -R {user}: "
                           f"{denied}), or run `oomguard service` in a directory {user} can write")


def _denied(account: pwd.struct_passwd, paths: Sequence[Path]) -> Path | None:
    """The first of ``paths`` that ``account`` cannot write (directories: also enter), or None."""
    groups = os.getgrouplist(account.pw_name, account.pw_gid)
    if os.geteuid() != 0:
        return next((p for p in paths if not _mode_allows(p, account.pw_uid, groups)), None)
    # As root, ask the kernel as that user: ACLs, read-only mounts and every parent's search bit count.
    script = 'for p; do { [ -w "$p" ] && { [ ! -d "$p" ] || [ -x "$p" ]; }; } || { printf %s "$p"; exit 1; }; done'
    done = subprocess.run(["/bin/sh", "-c", script, "sh", *map(str, paths)], capture_output=True, text=True,
                          user=account.pw_uid, group=account.pw_gid, extra_groups=groups, timeout=30)
    return Path(done.stdout) if done.returncode else None


def _mode_allows(path: Path, uid: int, groups: Sequence[int]) -> bool:
    """Write (and search, on a directory) for ``uid``, and search on every parent, from mode bits."""
    wanted = 0o3 if path.is_dir() else 0o2
    chain = [(path, wanted), *((parent, 0o1) for parent in path.parents)]
    return all(_bits(p, uid, groups) & need == need for p, need in chain)


def _bits(path: Path, uid: int, groups: Sequence[int]) -> int:
    """The rwx bits (as 0o7) that apply to ``uid`` on ``path``."""
    if uid == 0:
        return 0o7
    st = path.stat()
    return (st.st_mode >> (6 if st.st_uid == uid else 3 if st.st_gid in groups else 0)) & 0o7


def _write_unit(path: Path, text: str) -> None:
    try:
        write_atomic(path, text)
    except PermissionError as error:
        hint = "run with sudo, or use --print | sudo tee" if path.is_relative_to("/etc") else "check permissions"
        raise ServiceError(f"cannot write {path}: {error.strerror}; {hint}") from error


def next_steps(path: Path, scope: str, name: str) -> str:
    """What to run after the unit is written, as exact commands."""
    ctl, journal = ("sudo systemctl", "journalctl") if scope == SYSTEM else ("systemctl --user", "journalctl --user")
    lines = [f"Wrote {path}", f"  {ctl} daemon-reload", f"  {ctl} enable --now {name}", f"  {ctl} status {name}",
             f"  {journal} -u {name} -f"]
    if scope == USER:
        user = pwd.getpwuid(os.getuid()).pw_name
        lines.append(f"So that it keeps running after you log out: loginctl enable-linger {user}")
    return "\n".join(lines)
