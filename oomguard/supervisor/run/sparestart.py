"""A spare worker interpreter: imports the script's heavy modules now, becomes the next worker later.

Tested in tests/unit/supervisor/run/test_spare.py (real spares that become the worker).

Run by the worker's own Python under ``launch.py`` as ``python [flags] sparestart.py READY_FILE NICE
PATH0 [MODULE[:NAME,...]]...``; stdlib only (that interpreter may not have oomguard). It puts PATH0 (the
script's directory) first on ``sys.path``, lowers its priority by NICE, imports each third-party
MODULE and NAME (the user's own modules run the user's code: left to the script), checks it touched
no GPU and writes READY_FILE (JSON: ok, why, imported). It then waits for the handover on stdin (one
JSON object; EOF: not needed, exit 0) and becomes the worker: stdin from /dev/null, ``os.environ``
replaced wholesale (C's getenv sees it: PyTorch reads its allocator settings at the first CUDA
allocation, after this), cwd, argv, ``sys.path[0]``, priority and OOM score as a direct run's; then
it runs the script as ``__main__``.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import sys
import types
from typing import Any

THIRD_PARTY = ("site-packages", "dist-packages")


def _third_party(name: str) -> bool:
    """A module installed as a package (not the user's own, not the standard library)."""
    if name in sys.stdlib_module_names:
        return False
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = (spec.origin or "") if spec is not None else ""
    if spec is not None and not origin and spec.submodule_search_locations:
        origin = next(iter(spec.submodule_search_locations), "")
    real = os.path.realpath(origin) if origin else ""
    return any(part in real.split(os.sep) for part in THIRD_PARTY)  # a venv inside the project's too


def _import(item: str) -> str | None:
    """Import ``module[:name,name]``; the item as imported, or None when skipped or failed (the
    script meets the same failure itself, in its own words)."""
    module, _, names = item.partition(":")
    if not _third_party(module.split(".")[0]):
        return None
    try:
        loaded = importlib.import_module(module)
        for name in filter(None, names.split(",")):
            if getattr(loaded, name, None) is None:
                importlib.import_module(f"{module}.{name}")
    except Exception:  # an optional dependency missing, a broken install: the script will say
        return None
    return item


def _import_all(items: list[str]) -> list[str]:
    """Import the items with CUDA's initialization barred: a library that would create a CUDA
    context at import (and so hold GPU memory the running attempt may need) fails to import here
    instead, and the script imports it itself after the handover."""
    wants_torch = any(item.partition(":")[0].split(".")[0] == "torch" for item in items)
    torch = sys.modules.get("torch") if wants_torch and _import("torch") else None
    cuda = getattr(torch, "cuda", None)
    lazy_init = getattr(cuda, "_lazy_init", None)
    if cuda is not None and lazy_init is not None:
        cuda._lazy_init = _no_cuda
    try:
        return [done for item in items if (done := _import(item)) is not None]
    finally:
        if cuda is not None and lazy_init is not None:
            cuda._lazy_init = lazy_init


def _no_cuda() -> None:
    raise RuntimeError("oomguard's spare interpreter does not initialize CUDA")


def _gpu_touched() -> str:
    """Why this process may hold GPU memory, or ""."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "torch.cuda was initialized by an import"
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return ""
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            return f"an import opened {target}"
    return ""


def _write_ready(path: str, record: dict[str, object]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)


def _set_nice(value: int) -> None:
    """Every thread's priority (nice is per thread on Linux; imports may have started threads)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except OSError:
            continue


def _become(spec: dict[str, Any]) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    _set_nice(spec["nice"])
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
        fh.write(str(spec["oom_score_adj"]))
    sys.argv[:] = spec["argv"]
    sys.path[0] = spec["path0"]
    _run_as_main(spec["script"])


def _run_as_main(path: str) -> None:
    """What ``python script.py`` does: the script is the module ``__main__`` for good (not runpy's
    temporary one: pickles and atexit handlers see it), ``__file__`` absolute, ``sys.argv`` as given."""
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    with io.open_code(path) as fh:
        code = compile(fh.read(), path, "exec", dont_inherit=True)
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # shown as a direct run shows it: from the script's own frames on
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


def main() -> None:
    ready, nice, path0, items = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    sys.path[0] = path0
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if nice:
        os.nice(nice)
    imported = _import_all(items)
    touched = _gpu_touched()
    _write_ready(ready, {"ok": not touched, "why": touched, "imported": imported, "pid": os.getpid(),
                         "nice": before})
    if touched:  # leave at once: whatever it holds on a GPU, the running attempt may need
        os._exit(0)
    text = sys.stdin.read()
    if not text.strip():
        os._exit(0)
    _become(json.loads(text))


if __name__ == "__main__":
    main()
