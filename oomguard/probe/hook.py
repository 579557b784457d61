"""A post-import hook: call a function once a module has finished importing, never before.

Tested in tests/unit/probe/test_steps.py (the post-import hook) and tests/e2e/test_probe.py.

The probe must not import torch (a program that never does pays nothing) nor touch it half-built.
A finder first on ``sys.meta_path`` lets the other finders find the module, then wraps the found
loader so that the callback runs right after the module's own code. This is the technique of
wrapt's and ddtrace's post-import hooks; the module keeps its real loader in ``__spec__``.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: every Python process of the worker imports this module
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]


class _ThenCall:
    """The found loader, with ``callback`` run after it executed the module."""

    def __init__(self, loader: Any, callback: Callback) -> None:
        self._loader, self._callback = loader, callback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader while it runs (importlib.resources, pkgutil ask for it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)


class AfterImport:
    """A ``sys.meta_path`` finder that runs ``callback(module)`` once ``name`` is imported."""

    def __init__(self, name: str, callback: Callback) -> None:
        self.name, self._callback, self._searching = name, callback, False

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name or self._searching:
            return None  # the cost for every other import: one comparison
        self._searching = True
        try:
            spec = _find_elsewhere(self, fullname, path, target)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _ThenCall(spec.loader, self._imported)  # type: ignore[assignment]
        return spec

    def _imported(self, module: ModuleType) -> None:
        self.remove()  # once: later imports of the name are lookups in sys.modules
        self._callback(module)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _find_elsewhere(finder: AfterImport, fullname: str, path: Sequence[str] | None,
                    target: ModuleType | None) -> ModuleSpec | None:
    for other in list(sys.meta_path):
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def after_import(name: str, callback: Callback) -> None:
    """Run ``callback(module)`` once ``name`` has finished importing (now, if it already has)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    sys.meta_path.insert(0, AfterImport(name, callback))
