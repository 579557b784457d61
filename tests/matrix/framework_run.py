"""Run a framework's own training script, unmodified, as ``__main__`` and write what matrix_report
writes for a case (tests/probing_matrix.py reads it), for the frameworks' cases of the probe's matrix
(tests/e2e/test_probe_matrix_frameworks.py):

    python tests/matrix/framework_run.py SCRIPT [ARGS...]

(also as the script ``accelerate launch`` starts). The losses are every loss the process called
``backward`` on (HF Trainer, Lightning, accelerate and nanoGPT all end in ``Tensor.backward``), as
``float.hex``; the times, each optimizer step's main-thread CPU time since the last one. Beside them:
each optimizer step's optimizer and a digest of its parameters' bytes after it, and every frame
dynamo compiled (``get_compilation_metrics``: a recompile carries the guard that failed). Both runs
of a case go through this same wrapper, so what it adds (a wrapped ``Tensor.backward`` and one global
optimizer step hook, never inside a compiled region) is the same on both sides: only the probe
differs. Only a process that stepped an optimizer writes (not a launcher's, nor a compile worker's).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import runpy
import sys
import time
from typing import Any

import torch
from matrix_report import dynamo_counters
from torch.optim.optimizer import register_optimizer_step_post_hook

losses: list[str] = []
times: list[float] = []
steps: list[dict[str, str]] = []
last = [time.thread_time()]


def record_backward() -> None:
    """Every ``loss.backward()`` notes its loss first."""
    backward = torch.Tensor.backward

    def noted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.numel() == 1:
            losses.append(float(self.detach().float()).hex())
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = noted  # type: ignore[method-assign]


def record_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After each optimizer step: the parameters' bytes, so two runs are compared weight for weight."""
    now = time.thread_time()
    digest = hashlib.sha256()
    for group in optimizer.param_groups:
        for param in group["params"]:
            digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    steps.append({"optimizer": type(optimizer).__name__, "params": digest.hexdigest()})
    times.append(now - last[0])
    last[0] = time.thread_time()  # the digest's own time is no step's


def frames() -> list[dict[str, Any]]:
    """The frames dynamo compiled, each with its ops and, for a recompile, the guard that failed. Not the
    metrics of a compile that is no frame's (a backward compiled on a cold cache, only on that side)."""
    if "torch._dynamo" not in sys.modules:
        return []
    from torch._dynamo.utils import get_compilation_metrics

    return [{"code": f"{m.co_name} {m.co_filename}", "cache_size": m.cache_size, "ops": m.graph_op_count,
             "fail_type": m.fail_type, "recompile_reason": m.recompile_reason}
            for m in get_compilation_metrics() if m.co_name is not None]


def write() -> None:
    path = os.environ.get("MATRIX_OUT")
    if not path or not steps:
        return
    data = {"losses": losses, "times": times, "counters": dynamo_counters(), "steps": steps, "frames": frames()}
    with open(path, "w") as out:
        json.dump(data, out)


def main() -> None:
    record_backward()
    register_optimizer_step_post_hook(record_step)
    atexit.register(write)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
