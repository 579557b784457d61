"""``oomguard``: the command line. Options of ``run`` are generated from ``RunConfig``.

Tested in tests/unit/test_readme_commands.py, tests/unit/test_docs.py (the parser) and tests/e2e/ (every command).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sqlite3
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from oomguard import __version__
from oomguard.supervisor.config import add_arguments, build_config
from oomguard.supervisor.lifecycle import EXIT_CRASHED, UsageError
from oomguard.supervisor.ops import doctor, notify, systemd
from oomguard.supervisor.record import logs, report
from oomguard.supervisor.record import status as runs
from oomguard.supervisor.run.preflight import OptionParser, notices, split_command
from oomguard.supervisor.run.preflight import check as preflight
from oomguard.web.client import fetch_status, register_dashboard
from oomguard.web.client import register as web_commands


def _cmd_run(args: argparse.Namespace, command: Sequence[str]) -> int:
    from oomguard.supervisor.run.loop import Supervisor

    config = build_config(vars(args), command)  # the options by name (func, subcommand and typed are none)
    preflight(config)  # what a restart renders, rendered now: a bad quote is exit 2 here, not at 3 a.m.
    supervisor = Supervisor(config)
    supervisor.open()
    # How to resume after a stop, for status: the same line in the same directory (the journal and
    # the checkpoints carry the rest).
    supervisor.journal.set_meta(resume_command=f"cd {shlex.quote(str(supervisor.cwd))} && oomguard "
                                f"{shlex.join(args.typed)}" + (f" -- {shlex.join(command)}" if command else ""))
    for line in notices(config):  # forms that run, but not as they read (no accumulation, nanoGPT's total)
        logs.say(line)
        supervisor.journal.event("notice", None, text=line)
    supervisor.install_signal_handlers()
    from oomguard.supervisor.ops.hooks import attach_all

    closers = attach_all(supervisor)
    web = None
    try:
        if config.web.enabled:
            from oomguard.web.server import start_dashboard

            web = start_dashboard(supervisor)
        return supervisor.run()
    finally:
        if web is not None:
            from oomguard.web.server import stop_dashboard

            stop_dashboard(supervisor, web)
        for close in closers:
            close()
        supervisor.close()


def _cmd_status(args: argparse.Namespace, command: Sequence[str]) -> int:
    from oomguard.supervisor.record.status import format_status

    doc = fetch_status(Path(args.run_dir))  # the API while the supervisor runs, else the journal
    print(json.dumps(doc, indent=2) if args.json else format_status(doc))
    return 0


def _cmd_report(args: argparse.Namespace, command: Sequence[str]) -> int:
    if command:
        raise UsageError("report", "takes no command after --",
                         f"run: oomguard report --run-dir {shlex.quote(str(args.run_dir))}")
    doc = report.read_report(Path(args.run_dir))
    print(json.dumps(doc, indent=2, ensure_ascii=False) if args.json else report.format_report(doc))
    return 0


def _cmd_ls(args: argparse.Namespace, command: Sequence[str]) -> int:
    roots = [Path(d) for d in args.dirs] or [Path.cwd()]
    for root in roots:
        if not root.is_dir():
            raise UsageError("DIR", f"{root} is not a directory", "give directories that hold run directories")
    rows = runs.list_runs(roots, args.depth)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(runs.format_runs(rows))
    else:
        print(f"no oomguard runs under {', '.join(map(str, roots))} (searched {args.depth} levels deep)")
    return 0


def _add_view(sub: argparse._SubParsersAction, name: str, help: str, document: str,
              func: Callable[[argparse.Namespace, Sequence[str]], int]) -> None:
    """``status`` and ``report``: one run's picture, as text or JSON."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("--run-dir", default="oomguard-run", help="the run directory (default: oomguard-run)")
    parser.add_argument("--json", action="store_true", help=f"print the {document} as JSON")
    parser.set_defaults(func=func)


def _add_ls(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("ls", help="list every run under directories: state, batch, failures, "
                            "checkpoint, progress, supervisor, dashboard")
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="where to look (default: the current directory)")
    parser.add_argument("--depth", type=runs.depth, default=runs.MAX_DEPTH, metavar="N",
                        help=f"how many directory levels below each DIR to search (default: {runs.MAX_DEPTH})")
    parser.add_argument("--json", action="store_true", help="print the runs as a JSON list")
    parser.set_defaults(func=_cmd_ls)


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog="oomguard", description="Keep PyTorch training alive through OOMs.")
    parser.add_argument("--version", action="version", version=f"oomguard {__version__}")
    sub = parser.add_subparsers(dest="subcommand", required=True, parser_class=OptionParser)
    run = sub.add_parser("run", help="supervise a training command: oomguard run [options] -- COMMAND...")
    add_arguments(run)
    run.set_defaults(func=_cmd_run)
    _add_view(sub, "status", "show a run's state, batch and failures", "status document", _cmd_status)
    for register in EXTRA_COMMANDS:
        register(sub)
    return parser


# Every subcommand after run and status, in the order ``--help`` lists them: each takes the
# subparsers object and sets ``func`` on its parser. status, report and ls render the picture of a
# run (record/picture.py) and are registered here; the others' parsers live beside their commands.
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    web_commands,  # oomguard checkpoint | restart | stop
    lambda sub: _add_view(sub, "report", "summarise a run: time lost, failures, batch, checkpoints", "report",
                          _cmd_report),
    logs.add_logs_command,  # oomguard report | logs
    systemd.add_service_command, doctor.add_doctor_command,  # oomguard service | doctor
    _add_ls,  # oomguard ls
    notify.add_notify_test_command,  # oomguard notify-test
    register_dashboard,  # oomguard dashboard: the many-runs page
]


def main(argv: Sequence[str] | None = None) -> int:
    argv, command = split_command(sys.argv[1:] if argv is None else argv)
    args = argparse.Namespace()
    try:  # a bad option is a UsageError too (run/preflight.OptionParser)
        args = build_parser().parse_args(argv)
        args.typed = argv  # the words before --, as typed: status repeats them to say how to resume
        code = int(args.func(args, command))
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at exit
        return code
    except UsageError as exc:
        print(f"oomguard: error: {exc}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as exc:  # damage found past the checks at open
        run_dir = getattr(args, "run_dir", "oomguard-run")
        print(f"oomguard: error: --run-dir: the journal in {run_dir} cannot be read ({exc}); move "
              f"{Path(run_dir) / 'journal.sqlite'} aside and run again", file=sys.stderr)
        return 2
    except BrokenPipeError:  # oomguard status | head -3: the reader is gone, and that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130
    except Exception:  # oomguard's own bug: not 1, which says the run gave up and is not restarted
        traceback.print_exc()
        return EXIT_CRASHED


if __name__ == "__main__":
    sys.exit(main())
