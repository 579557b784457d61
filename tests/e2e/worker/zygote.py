"""A fork server for the kill tests: imports torch and the demo once, then forks real worker
processes on request, so dozens of kill -9 points cost milliseconds each instead of an import.

Protocol on stdin/stdout, one JSON object per line:
    {"op": "spawn", "argv": [...], "env": {...}, "log": "path"}  ->  {"pid": 1234}
    {"op": "wait", "pid": 1234}                                  ->  {"status": 0 | -9 | ...}
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch  # noqa: F401  (imported here so that children start with it loaded)

DEMO = Path(__file__).resolve().parents[3] / "examples" / "train_worker_demo.py"


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_worker_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(demo: ModuleType, request: dict[str, Any]) -> None:
    """In the forked child: private stdio, the requested environment, then the demo's main()."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.environ.update(request.get("env", {}))
    code = 1
    try:
        code = demo.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child must never return into the server loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def warm_up(demo: ModuleType) -> None:
    """One tiny run in the server, so children do not each pay for torch's lazy imports (the
    optimizer step pulls in torch._dynamo). One thread: no OpenMP pool exists before a fork."""
    null = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(null, 2)
    try:
        demo.main(["--steps", "1", "--global-batch", "4", "--threads", "1", "--dataset-size", "8"])
    finally:
        os.dup2(saved, 2)


def main() -> None:
    demo = load_demo()
    warm_up(demo)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                child(demo, request)
            reply: dict[str, Any] = {"pid": pid}
        else:
            _, status = os.waitpid(request["pid"], 0)
            code = os.waitstatus_to_exitcode(status)
            reply = {"status": code}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
