"""How far through its forward pass a process was when memory ran out, and what it held before it.

Tested in tests/e2e/test_probe_compile.py, tests/e2e/test_probe.py and tests/e2e/test_probe_matrix.py.

The supervisor can extrapolate a step's need from an OOM only if it knows what share of the work
the memory at the OOM paid for. torch's global module hooks
(``torch.nn.modules.module.register_module_forward_pre_hook`` / ``register_module_forward_hook``)
see every module's forward; this tracker counts the leaf modules (those with no children) run in
the current outermost forward, and reads the memory held before the step's first forward (the
fixed memory: weights, and after a step the optimizer state) so the rest can be scaled.

- The fraction of the forward done is the leaf forwards run so far over those of a complete forward
  of the same outermost module (learned from its first complete one); before any completed, over
  the leaf modules the outermost module holds.
- Once the outermost forward has returned, the forward is done: an OOM then came in the loss or
  the backward.

The hooks are armed only until the process's first optimizer step (``stepped``): the OOM a too-large
micro-batch meets comes in the first step, and after it a module call takes torch's fast path
again (no global hook), so a training run pays the hooks for one step only.

Under ``torch.compile`` the hooks must be gone before dynamo traces anything: dynamo inlines every
global module hook into the graph it builds (our side effects broke its tracing: "already tracked
for mutation") and guards on how many there are (removing them at the first step then recompiled
every graph). ``compiled()`` disarms the tracker for good, called from two places:

- ``torch.compile`` itself, wrapped (``wrap_compile``): ``torch.compile(model)``, ``model.compile()``
  and ``@torch.compile`` all call it before anything runs compiled. Disarming at the compile's start
  would be too late there: the compiled module's first call runs the hooks first (torch warns
  "global hooks on modules" on the program's stderr, and dynamo counts our hook's frame as one more).
- Dynamo's compile-start callbacks (``torch._dynamo.callback_handler.register_start_callback``, run
  before ``_compile_inner`` traces a frame), for a compile that does not go through ``torch.compile``
  (``torch._dynamo.optimize``, a framework's own entry); registered once the program imported
  ``torch._dynamo`` (``watch``): the probe never imports dynamo itself. A dynamo without the callback
  (torch before 2.4) gets the tracker disarmed at its import instead.

Such a process has no forward figures, and says so once at its first step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import channel, memory
from .start import after_import


class ForwardTracker:
    """The forward's progress and the fixed memory, for the ``oom`` record (``figures``)."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._handles: list[Any] = []
        compiler = getattr(torch, "compiler", None)
        # True while dynamo traces (a hook traced into a graph must do nothing); torch < 2.3 has none.
        self._compiling: Any = getattr(compiler, "is_compiling", None) or (lambda: False)
        self.off_for_compile = False  # disarmed at a torch.compile before the first step: no forward figures
        self.forget()

    def forget(self) -> None:
        """Start from nothing (also in a forked child)."""
        self._depth = 0  # module forwards in progress
        self._root: Any = None  # the outermost module of the forward in progress (or the last one)
        self._leaves = 0  # leaf forwards run in it
        self._learned: dict[int, int] = {}  # id(outermost module) -> leaf forwards of a complete forward
        self._held: dict[int, int] = {}  # id(outermost module) -> the leaf modules it holds
        self._fixed: dict[str, int] | None = None
        self._done = False  # the outermost forward returned (nothing started since)
        self.after_step: dict[str, int] = {}  # memory.held() right after the first optimizer step

    @property
    def root(self) -> Any:
        """The outermost module of the last forward (None before any, or once ``forget`` ran)."""
        return self._root

    def arm(self) -> None:
        module = self._torch.nn.modules.module
        self._handles = [module.register_module_forward_pre_hook(self.pre),
                         module.register_module_forward_hook(self.post)]

    def disarm(self) -> None:
        """Remove the hooks: module calls are free again."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def compiled(self) -> None:
        """Dynamo is about to trace: disarm before it sees the hooks (once armed, never again)."""
        if self._handles:
            self.disarm()
            self.off_for_compile = True

    def stepped(self) -> None:
        """The process's first optimizer step: disarm, and read what it holds now that its optimizer
        state and gradients exist and the step's activations are freed (a truer fixed memory than
        before the first forward, for the line ``--grow`` fits)."""
        self.disarm()
        try:
            self.after_step = memory.held(self._torch)
        except Exception:
            self.after_step = {}

    def step_figures(self) -> dict[str, Any]:
        """What ``step`` records carry from the tracker: the memory held after the first step."""
        return {"held_after_first_step": self.after_step} if self.after_step else {}

    def pre(self, module: Any, args: Any) -> None:
        """The global forward pre-hook. Never raises into the program."""
        if self._compiling():
            return  # traced by dynamo (a torch without its compile-start callback): nothing in the graph
        try:
            # The outermost module entered again inside its own forward: that forward never returned (an
            # OOM the script caught, its post hooks skipped), so this is a new one, not more of it.
            if self._depth == 0 or module is self._root:
                self._depth = 0
                self._root_starts(module)
            self._depth += 1
            if not module._modules:
                self._leaves += 1
        except Exception:
            self.disarm()  # a module this tracker cannot read: no figures rather than a broken run

    def post(self, module: Any, args: Any, output: Any) -> None:
        """The global forward hook: at the outermost module's return, the forward is complete."""
        if self._compiling():
            return
        self._depth -= 1
        if self._depth <= 0:
            self._depth = 0
            self._done = True
            self._learned.setdefault(id(module), self._leaves)

    def _root_starts(self, module: Any) -> None:
        if self._fixed is None:  # the step's first forward: what is held now does not follow the batch
            self._fixed = memory.held(self._torch)
        self._root, self._leaves, self._done = module, 0, False
        if id(module) not in self._held:
            self._held[id(module)] = sum(1 for m in module.modules() if not m._modules)

    def figures(self, measure: str) -> dict[str, Any]:
        """The progress and the fixed memory in ``measure`` (``memory.held``'s keys), at an OOM."""
        fixed = None if self._fixed is None else self._fixed.get(measure)
        if self._root is None or self.off_for_compile:  # the count stopped mid-forward: no fraction
            return {"fixed_bytes": fixed, "forward_fraction": None, "forward_basis": None, "forward_leaves": None}
        if self._done:
            whole, basis = self._leaves, "done"
        elif (learned := self._learned.get(id(self._root))) is not None:
            whole, basis = learned, "learned"
        else:
            whole, basis = self._held.get(id(self._root), 0), "modules"
        fraction = round(min(1.0, self._leaves / whole), 4) if whole else None
        return {"fixed_bytes": fixed, "forward_fraction": fraction, "forward_basis": basis,
                "forward_leaves": self._leaves}


def install(torch: Any) -> ForwardTracker | None:
    """Arm the tracker; None where this torch has no global module hooks (the rest of the probe runs)."""
    module = getattr(getattr(torch, "nn", None), "modules", None)
    module = getattr(module, "module", None)
    if module is None or not hasattr(module, "register_module_forward_pre_hook"):
        return None
    tracker = ForwardTracker(torch)
    tracker.arm()
    return tracker


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

    after_import("torch._dynamo", imported)


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
