"""The probe under torch.compile and with the program's own CUDA statistics, without a matrix run:
the forward tracker steps aside before dynamo sees it, the hooks do nothing when traced, the
allocator's peaks are read and never reset, and what status says about a part left undone."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from probing import records, run_script
from torch import nn

from oomguard.probe import forward
from oomguard.probe.memory import device_peaks
from oomguard.probe.steps import StepCounter
from oomguard.supervisor.observe.allocator import ProbeReport
from oomguard.supervisor.record.status import probe_text


class FakeCuda:
    """torch.cuda's statistics API for two devices; any reset is recorded (the probe must make none)."""

    def __init__(self) -> None:
        self.resets: list[int] = []
        self.allocated = {0: 3 << 30, 1: 0}
        self.reserved = {0: 4 << 30, 1: 0}

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def max_memory_allocated(self, index: int) -> int:
        return self.allocated[index]

    def max_memory_reserved(self, index: int) -> int:
        return self.reserved[index]

    def reset_peak_memory_stats(self, index: int) -> None:
        self.resets.append(index)

    def get_device_properties(self, index: int) -> Any:
        return type("Props", (), {"total_memory": 80 << 30})()

    def get_per_process_memory_fraction(self, index: int) -> float:
        return 1.0


def test_the_peaks_are_the_allocators_and_never_reset() -> None:
    cuda = FakeCuda()
    fake = type("Torch", (), {"cuda": cuda})()
    first = device_peaks(fake)
    cuda.allocated[0] = 5 << 30  # the program's step went higher; its own reading is 5 GiB, and so is ours
    second = device_peaks(fake)
    assert cuda.resets == []
    assert first == {"cuda:0": {"allocated_peak": 3 << 30, "reserved_peak": 4 << 30, "limit_bytes": 80 << 30}}
    assert second["cuda:0"]["allocated_peak"] == 5 << 30 and "cuda:1" not in second  # device 1: never used here


def test_forward_hooks_are_gone_before_torch_compile_returns() -> None:
    tracker = forward.ForwardTracker(torch)
    tracker.arm()
    saved = torch.compile
    try:
        forward.wrap_compile(torch, tracker.compiled)
        module = torch.nn.modules.module
        assert module._global_forward_pre_hooks and module._global_forward_hooks
        torch.compile(nn.Linear(2, 2), backend="eager")  # never called: wrapping is lazy
        assert not module._global_forward_pre_hooks and not module._global_forward_hooks
        assert tracker.off_for_compile
        tracker.compiled()  # every later compile: nothing more to do
    finally:
        torch.compile = saved
        tracker.disarm()
    assert tracker.figures("rss")["forward_fraction"] is None  # the count stopped: no fraction from it


def test_a_compile_start_disarms_where_torch_compile_was_not_called() -> None:
    """torch._dynamo.optimize, or a framework's own entry: dynamo's compile-start callback disarms."""
    import torch._dynamo

    tracker = forward.ForwardTracker(torch)
    tracker.arm()
    handler = torch._dynamo.callback_handler
    before = list(handler.start_callbacks)
    try:
        forward.at_compile_start(torch._dynamo, tracker.compiled)
        optimized = torch._dynamo.optimize("eager")(lambda x: x * 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optimize() is deprecated: here on purpose
            assert optimized(torch.ones(2)).tolist() == [2.0, 2.0]
        assert tracker.off_for_compile and not torch.nn.modules.module._global_forward_pre_hooks
    finally:
        handler.start_callbacks[:] = before
        tracker.disarm()


def test_the_hooks_do_nothing_while_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    tracker = forward.ForwardTracker(torch)  # takes the test's is_compiling
    counter = StepCounter(torch)
    tracker.pre(nn.Linear(2, 2), ())
    tracker.post(nn.Linear(2, 2), (), None)
    counter.on_step(object(), (), {})
    assert tracker.figures("rss")["forward_leaves"] is None and tracker._depth == 0
    assert counter.step == 0 and counter.compiled_steps_seen


def test_status_says_what_the_probe_left_undone() -> None:
    report = ProbeReport()
    report.take({"type": "probe", "state": "partial", "pid": 7, "rank": None,
                 "detail": "optimizer steps run inside torch.compile are not counted: dynamo would trace it"})
    meta = report.as_meta()
    assert meta["state"] == "loaded" and meta["processes"] == 1
    assert probe_text(meta) == ("loaded in 1 process; not done in 1: optimizer steps run inside torch.compile "
                                "are not counted: dynamo would trace it")


GPT = '''
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, idx):
        x = self.emb(idx)
        return nn.functional.cross_entropy(self.head(x + self.mlp(x)).flatten(0, 1), idx.flatten())

model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = torch.compile(model, backend="eager")
for i in range(3):
    loss = step(torch.randint(0, 32, (2, 8)))
    loss.backward()
    opt.step()
    opt.zero_grad()
from torch._dynamo.utils import counters
print("frames", dict(counters["frames"]), "graphs", counters["stats"]["unique_graphs"], flush=True)
'''


def test_a_compiled_model_trains_under_the_probe_with_the_graphs_it_has_without(tmp_path: Path) -> None:
    """The issue's crash ('already tracked for mutation ... probe/forward.py, in pre') and torch's
    'global hooks' warning, in a small process: neither now, one frame and one graph as without."""
    out = run_script(tmp_path, GPT)
    assert "frames {'total': 1, 'ok': 1} graphs 1" in out.stdout, out.stdout + out.stderr
    assert "global hooks" not in out.stderr
    [partial] = [r for r in records(tmp_path, "probe") if r["state"] == "partial"]
    assert "no forward figures" in partial["detail"]
    assert [r["step"] for r in records(tmp_path, "step")][-1] == 3


def test_the_probe_does_not_import_dynamo(tmp_path: Path) -> None:
    out = run_script(tmp_path, "import sys, torch\nprint('torch._dynamo' in sys.modules)\n")
    assert out.stdout.strip() == "False"  # a program that never compiles never pays for dynamo's import
