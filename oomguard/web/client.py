"""The CLI's side of the API: ``oomguard checkpoint|restart|stop``, ``oomguard status`` and
``oomguard dashboard`` (the many-runs page, web/fleet.py; its server is imported only when it runs).

Tested in tests/e2e/test_operator.py (``oomguard checkpoint|restart|stop``) and tests/e2e/web/.

The address comes from the journal (``web_url``, recorded by the running supervisor) and the
token from ``RUN_DIR/token``; stdlib ``urllib`` keeps these commands quick to start.

Also here:

- ``oomguard checkpoint``: ask for a checkpoint and say whether one was written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import Journal, open_existing
from oomguard.supervisor.record.status import read_status, supervisor_alive

TIMEOUT = 5.0
ACTIONS = {"checkpoint": "ask the running worker to write a checkpoint now",
           "restart": "restart the worker (from the newest checkpoint)",
           "stop": "stop the worker and the supervisor gracefully"}


def _meta(run_dir: Path) -> dict[str, Any]:
    journal = open_existing(run_dir)
    try:
        return journal.meta()
    finally:
        journal.close()


def _request(url: str, token: str | None = None, method: str = "GET") -> dict[str, Any]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def fetch_status(run_dir: Path) -> dict[str, Any]:
    """The status document from the running supervisor's API, else from the journal."""
    meta = _meta(run_dir)
    if meta.get("web_url") and supervisor_alive(meta):
        try:
            token = (run_dir / "token").read_text().strip() if (run_dir / "token").exists() else None
            return _request(meta["web_url"] + "api/status", token)  # a network bind needs it for reads
        except (OSError, ValueError):  # server busy or gone: the journal says the same
            pass
    return read_status(run_dir)


def control(run_dir: Path, action: str) -> str:
    """Send one control request to the run's supervisor; returns what to tell the user."""
    meta = _meta(run_dir)
    if not supervisor_alive(meta):
        raise UsageError("--run-dir", f"the supervisor of {run_dir} is not running", "nothing to control")
    url = meta.get("web_url")
    if not url:
        return _without_web(meta, action)
    token = _read_token(run_dir)
    try:
        _request(f"{url}api/control/{action}", token, "POST")
    except urllib.error.HTTPError as exc:
        raise UsageError(action, f"the supervisor refused: HTTP {exc.code} {_detail(exc)}",
                         f"check {run_dir / 'token'}") from None
    except OSError as exc:
        raise UsageError(action, f"cannot reach the supervisor at {url} ({exc})",
                         f"is it running? see oomguard status --run-dir {shlex.quote(str(run_dir))}") from None
    return f"{action} requested (pid {meta.get('supervisor_pid')})"


def _without_web(meta: dict[str, Any], action: str) -> str:
    """Started with --no-web: SIGTERM is the supervisor's own graceful stop; nothing else can be asked."""
    if action != "stop":
        raise UsageError(action, "the supervisor runs without the dashboard (--no-web)",
                         "restart it without --no-web to use this command")
    os.kill(int(meta["supervisor_pid"]), signal.SIGTERM)
    return f"stop requested (SIGTERM to pid {meta['supervisor_pid']})"


def _read_token(run_dir: Path) -> str:
    try:
        return (run_dir / "token").read_text().strip()
    except OSError as exc:
        raise UsageError("--run-dir", f"cannot read {run_dir / 'token'} ({exc.strerror})",
                         "run this as the user who started oomguard") from None


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("detail", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _cmd_control(args: argparse.Namespace, command: Sequence[str]) -> int:
    run_dir = Path(args.run_dir)
    if args.subcommand == "checkpoint":
        from oomguard.web.client import ask_and_wait

        return ask_and_wait(run_dir, args.wait, lambda: control(run_dir, "checkpoint"), lambda s: print(s, flush=True))
    print(control(run_dir, args.subcommand))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for action, help_text in ACTIONS.items():
        parser = sub.add_parser(action, help=help_text)
        parser.add_argument("--run-dir", default="oomguard-run",
                            help="the run directory (default: oomguard-run)")
        if action == "checkpoint":
            from oomguard.web.client import DEFAULT_WAIT

            parser.add_argument("--wait", type=_seconds, default=DEFAULT_WAIT, metavar="SECONDS",
                                help="how long to wait for the checkpoint to appear; exit 1 when none does "
                                f"(default: {DEFAULT_WAIT:g}; 0: only ask)")
        parser.set_defaults(func=_cmd_control)


def _cmd_dashboard(args: argparse.Namespace, command: Sequence[str]) -> int:
    from oomguard.web.server import serve_fleet

    roots = [Path(d) for d in args.dirs] or [Path.cwd()]
    for root in roots:
        if not root.is_dir():
            raise UsageError("DIR", f"{root} is not a directory", "give directories that hold run directories")
    return serve_fleet(roots, args.host, args.port, args.depth)


def register_dashboard(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from oomguard.supervisor.record.status import MAX_DEPTH, depth

    parser = sub.add_parser("dashboard", help="serve one page listing every run under directories, live, each "
                            "linked to its own view")
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="where to look (default: the current directory)")
    parser.add_argument("--depth", type=depth, default=MAX_DEPTH, metavar="N",
                        help=f"how many directory levels below each DIR to search (default: {MAX_DEPTH})")
    parser.add_argument("--host", default="127.0.0.1", metavar="H",
                        help="address to listen on; any but loopback needs the token link printed at start "
                        "(default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8760, metavar="P",
                        help="port; a free one when 8760 is taken, 0: any free port (default: 8760)")
    parser.set_defaults(func=_cmd_dashboard)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} is below 0 (0: only ask, do not wait)")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535; 0: any free port)")
    return value


# ``oomguard checkpoint``: ask for a checkpoint and say whether one was written.
#
# It used to print ``checkpoint requested`` and exit 0 whatever happened, also when the worker had no
# handler for the signal and nothing was ever written. Now it follows the journal after the request:
# the loop's ``checkpoint_request`` event says whether the signal was sent (only to a worker that
# handles it; the request file is written either way, for scripts that poll it), and a ``checkpoint``
# event, or the worker removing the request file (the protocol's acknowledgement), says one was
# written. Nothing within ``--wait`` seconds: one line saying so, exit 1.


DEFAULT_WAIT = 300.0  # a large model's state takes minutes to write; --wait 0 only asks
POLL = 0.2
REQUEST_FILE = "checkpoint.request"  # run/process.py's AttemptFiles.checkpoint_request
_OVER = frozenset({"stopped", "failed", "succeeded"})


def ask_and_wait(run_dir: Path, wait: float, send: Callable[[], str], say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> int:
    """Send the request (``send``), then follow the journal for up to ``wait`` seconds; 0 when a
    checkpoint was written, 1 when none was."""
    journal = open_existing(run_dir)
    try:
        since, meta = journal.last_event_id(), journal.meta()
        say(send())
        if wait <= 0:
            return 0
        return _follow(journal, run_dir, since, meta, wait, say, clock)
    finally:
        journal.close()


def _follow(journal: Journal, run_dir: Path, since: int, meta: dict[str, Any], wait: float,
            say: Callable[[str], None], clock: Callable[[], float]) -> int:
    started, handled = clock(), None
    signal_name = (meta.get("config") or {}).get("checkpoint_signal", "SIGUSR1")
    while clock() - started < wait:
        for event in journal.events(since):
            since, kind, data = event["id"], event["kind"], event["data"]
            if kind == "checkpoint_request" and data.get("reason") == "requested" and handled is None:
                handled = data.get("signal") is not None
                if not handled:
                    say(f"the worker has no handler for {signal_name}: only the request file was written "
                        f"({run_dir / REQUEST_FILE}), which a script must poll (the worker library does both)")
            elif kind == "checkpoint":
                step = f" (step {data['step']})" if data.get("step") is not None else ""
                say(f"checkpoint written: {data['path']}{step}, {clock() - started:.0f} s after the request")
                return 0
            elif kind == "state" and data.get("to") in _OVER:
                say(f"no checkpoint: the run ended ({data['to']}: {data.get('reason', '')})")
                return 1
        if handled is not None and not (run_dir / REQUEST_FILE).exists():
            say("the worker acknowledged the request (it removed the request file)"
                + ("" if (meta.get("config") or {}).get("checkpoints") else
                   "; no --checkpoint glob is watched, so oomguard cannot name the file"))
            return 0
        time.sleep(POLL)
    why = "" if handled is not False else f" (the worker does not handle {signal_name})"
    say(f"no checkpoint appeared within {wait:g} s{why}; see oomguard logs --run-dir {run_dir}")
    return 1
