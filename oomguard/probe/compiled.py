"""What the probe does when the program compiles: it steps aside before dynamo sees anything.

Tested in tests/e2e/test_probe_compile.py and tests/e2e/test_probe_matrix.py.

Dynamo inlines torch's global module hooks into every graph it builds and guards on how many there
are, so the forward tracker's hooks (probe/forward.py) must be gone before the first trace, not at the
first optimizer step. Two places disarm the tracker:

- ``torch.compile`` itself, wrapped (as ``torch.save`` is, probe/saves.py): ``torch.compile(model)``,
  ``model.compile()`` and ``@torch.compile`` all call it before anything runs compiled. Disarming
  only at the compile's start would be too late there: the compiled module's first call runs the
  hooks first (torch warns "global hooks on modules" on the program's stderr, and dynamo counts our
  hook's frame as one more it tried).
- Dynamo's compile-start callbacks (``torch._dynamo.callback_handler.register_start_callback``, run in
  ``convert_frame.compile_inner`` before ``_compile_inner`` traces a frame), for a compile that does
  not go through ``torch.compile`` (``torch._dynamo.optimize``, a framework's own entry). Registered once
  ``torch._dynamo`` finished importing (probe/hook.py): the probe never imports dynamo itself. A
  dynamo without the callback (torch before 2.4) gets the tracker disarmed at its import instead.

A program that never compiles keeps its forward figures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import channel, hook


def at_compile_start(dynamo: ModuleType, disarm: Callable[[], None]) -> None:
    """Call ``disarm()`` when dynamo starts compiling (every compile: ``disarm`` is idempotent)."""
    register = getattr(getattr(dynamo, "callback_handler", None), "register_start_callback", None)
    if register is None:
        disarm()  # no way to be told before a trace: step aside now that dynamo is here
        return

    def started(args: Any) -> None:
        # Inside dynamo's compile: an exception here would fail the program's compile.
        try:
            disarm()
        except Exception as exc:
            channel.failed(f"compile-start callback: {type(exc).__name__}: {exc}")

    register(started)


def watch(disarm: Callable[[], None]) -> None:
    """Arrange ``at_compile_start`` for when (if ever) the program imports ``torch._dynamo``."""
    def imported(dynamo: ModuleType) -> None:
        # Runs at the end of the program's import of torch._dynamo: an exception would fail it.
        try:
            at_compile_start(dynamo, disarm)
        except Exception as exc:
            disarm()
            channel.failed(f"compile watch not installed: {type(exc).__name__}: {exc}")

    hook.after_import("torch._dynamo", imported)


_MARK = "_oomguard_compile"


def wrap_compile(torch: Any, disarm: Callable[[], None]) -> None:
    """Wrap ``torch.compile`` (once) to call ``disarm()`` first; what it returns or raises is its own."""
    original = getattr(torch, "compile", None)
    if original is None or getattr(original, _MARK, False):
        return  # torch before 2.0 has none: nothing compiles through it

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        try:
            disarm()
        except Exception as exc:
            channel.failed(f"compile wrapper: {type(exc).__name__}: {exc}")
        return original(*args, **kwargs)

    setattr(compile, _MARK, True)
    torch.compile = compile
