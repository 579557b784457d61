"""Run a training script as ``__main__`` and record what the probe matrix compares between a run
without the probe and one with it (tests/test_probe_matrix_frameworks.py).

    MATRIX_RECORD=DIR python tests/workers/matrix_record.py SCRIPT [ARGS...]

(also as the script ``accelerate launch`` starts in each rank). At exit each process writes
``DIR/<pid>.json``: every loss it called ``backward`` on (``float`` of the tensor: exact for float32),
every optimizer step (the optimizer's class, a digest of its parameters' bytes after the step, the
clock), dynamo's counters (``torch._dynamo.utils.counters``) and each frame it compiled
(``get_compilation_metrics``: a recompile carries the guard that failed). Both runs of a case go through this
same wrapper, so what it adds (a wrapped ``Tensor.backward`` and one global optimizer step hook, never
inside a compiled region) is the same on both sides; only the probe differs.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

losses: list[float] = []
steps: list[dict[str, Any]] = []


def record_backward() -> None:
    """Every ``loss.backward()`` (HF Trainer, Lightning, accelerate and nanoGPT all end in it) notes its loss."""
    backward = torch.Tensor.backward

    def noted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.numel() == 1:
            losses.append(float(self.detach()))
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = noted  # type: ignore[method-assign]


def record_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After each optimizer step: the parameters' bytes, so two runs are compared weight for weight."""
    digest = hashlib.sha256()
    for group in optimizer.param_groups:
        for param in group["params"]:
            digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    steps.append({"optimizer": type(optimizer).__name__, "params": digest.hexdigest(), "t": time.monotonic()})


def write(out: Path) -> None:
    # At exit: an eager script imports dynamo no sooner than it would.
    from torch._dynamo.utils import counters, get_compilation_metrics

    # One entry per frame dynamo compiled; a recompile is one with a reason (the guard that failed).
    compiles = [{"code": f"{m.co_name} {m.co_filename}", "cache_size": m.cache_size, "ops": m.graph_op_count,
                 "fail_type": m.fail_type, "recompile_reason": m.recompile_reason}
                for m in get_compilation_metrics()]
    doc = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "losses": losses, "steps": steps,
           "counters": {section: dict(values) for section, values in counters.items()}, "compiles": compiles}
    (out / f"{os.getpid()}.json").write_text(json.dumps(doc))


def main() -> None:
    out = Path(os.environ["MATRIX_RECORD"])
    out.mkdir(parents=True, exist_ok=True)
    record_backward()
    register_optimizer_step_post_hook(record_step)
    atexit.register(write, out)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
