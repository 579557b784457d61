"""Which model a process trains, as the memory per sample sees it: one ``model`` record per process.

Tested in tests/unit/probe/test_steps.py (the model's fingerprint) and tests/e2e/test_probe.py.

At the process's first optimizer step the optimizer's ``param_groups`` hold what it trains: the
digest covers the optimizer's class and, in order, each parameter's shape, dtype and
``requires_grad``, so a layer more, a wider embedding, a longer position table, half precision
or frozen weights are another model, whatever file or variable changed it. The supervisor's fit
store keeps the digest with what it measured, so a re-run whose model changed where the command
does not show it (an imported ``model.py``, a config opened by a fixed path, a hub model) is not
started at a size measured for another model.

The forward's per-sample input shape is left out of the digest: an HF-style call passes its
tensors as keyword arguments, which torch's global forward pre-hook does not see, and a
dynamically padded batch has a different length from one run's first batch to another's, which
would make the same job look like a new model (and restart it for nothing). A model whose
sequence length is in its weights (nanoGPT's ``wpe``) is caught by the shapes.

Read once per process, never per step: ``python bench/probe_cost.py`` times it (docs/probe.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..common import protocol
from . import channel


def fingerprint(optimizer: Any) -> dict[str, Any]:
    """The ``model`` record's fields for ``optimizer`` (raises on an optimizer torch would not step)."""
    kind = type(optimizer)
    parts = [f"{kind.__module__}.{kind.__qualname__}"]
    tensors = params = 0
    for group in optimizer.param_groups:
        parts.append("|")  # a group boundary: the same tensors split otherwise is another optimizer setup
        for param in group["params"]:
            parts.append(f"{tuple(param.shape)}{param.dtype}{int(param.requires_grad)}")
            tensors += 1
            params += param.numel()
    digest = hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]
    return {"digest": digest, "params": params, "tensors": tensors, "optimizer": kind.__qualname__}


def report(optimizer: Any) -> None:
    """Write this process's ``model`` record. Never raises into the program's step."""
    try:
        fields = fingerprint(optimizer)
    except Exception as exc:  # an optimizer of a shape we cannot read: the run goes on, unfingerprinted
        channel.failed(f"model fingerprint: {type(exc).__name__}: {exc}")
        return
    channel.emit(protocol.MODEL, **fields)
