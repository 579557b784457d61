"""Capturing and restoring every random stream a training step may draw from.

The state is kept in plain types and tensors so checkpoints load with ``weights_only=True``
(no pickle of arbitrary objects): Python's ``random``, NumPy's legacy global generator, torch's
CPU generator and the generator of every CUDA device.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for the worker
    np = None  # type: ignore[assignment]


def capture() -> dict[str, Any]:
    """A snapshot of all random streams, safe to ``torch.save``."""
    state: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = _numpy_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every random stream back where ``capture`` found it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        _restore_numpy(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state() -> tuple[int, list[int], float | None]:
    version, internal, gauss = random.getstate()
    return version, list(internal), gauss


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "name": str(name),
        "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _restore_numpy(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))
