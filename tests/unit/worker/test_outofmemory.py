"""In-process OOM recovery with PyTorch's real host allocator error.

An allocation of 2**60 bytes makes ``DefaultCPUAllocator`` fail for real (no mock): the failing
code below holds real activations when it fails, in forward, in backward and in the optimizer
step, and the session must free them, rewind and retry the same global batch smaller. Also the
micro-batch arithmetic and the tuner (worker/outofmemory.py), pure code tested alone.
"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from oomguard.worker import OutOfMemoryAbort, Session, SessionConfig, Tuner, classify, shrink
from oomguard.worker.outofmemory import MemoryProbe, grow, release_memory

IMPOSSIBLE = 2**60


def real_oom() -> None:
    torch.empty(IMPOSSIBLE, dtype=torch.uint8)  # raises RuntimeError from DefaultCPUAllocator


def make(seed: int = 0, dropout: float = 0.2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train(loss_fn: Any, steps: int, micro: int) -> tuple[nn.Module, list[int]]:
    model, opt = make()
    x, y = data()
    ooms = []
    with Session(
        model, opt, loss_fn, SessionConfig(global_batch=16, micro_batch=micro, grow_after=None)
    ) as s:
        for step in range(steps):
            ooms.append(s.step((x[step * 16 % 64 :][:16], y[step * 16 % 64 :][:16])).ooms)
    return model, ooms


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_the_allocator_error_is_real_and_classified() -> None:
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory") as info:
        real_oom()
    assert classify(info.value) == "host_oom"
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered")) == "cuda_fatal"
    assert classify(RuntimeError("CUDA error: device-side assert triggered")) == "cuda_fatal"
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "cuda_oom"
    assert classify(ValueError("shapes")) is None


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_in_forward_or_backward_retries_the_same_batch_and_rng(phase: str) -> None:
    class BigBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if grad.shape[0] > 4:
                real_oom()
            return grad

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if phase == "forward" and x.shape[0] > 4:
            model(x)  # real activations exist when the allocation fails
            real_oom()
        hidden = BigBackward.apply(model[0](x))  # its backward runs, and fails, for real
        return nn.functional.mse_loss(model[3](model[2](model[1](hidden))), y)

    # Started at 16 and pushed down to 4 in the first step, with dropout: bit for bit the run
    # that used 4 from the start, because the retry rewinds the random streams too.
    recovered, ooms = train(loss_fn, steps=6, micro=16)
    direct, _ = train(loss_fn, steps=6, micro=4)
    assert ooms == [2, 0, 0, 0, 0, 0]  # 16 and 8 failed in the first step, 4 held after
    assert same(recovered, direct)


def test_oom_in_optimizer_state_allocation_is_clean_and_retried() -> None:
    model, opt = make()
    failures = {"left": 1}

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if failures["left"]:
            failures["left"] -= 1
            real_oom()

    opt.register_step_pre_hook(hook)
    x, y = data()
    with Session(model, opt, mse, SessionConfig(global_batch=16, grow_after=None)) as session:
        result = session.step((x[:16], y[:16]))
    assert result.ooms == 1 and result.micro_batch == 8 and result.step == 1


def test_oom_after_the_optimizer_changed_weights_gives_up(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("OOMGUARD_EVENTS", str(tmp_path / "events.jsonl"))
    model, opt = make()

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            optimizer.param_groups[0]["params"][0].add_(1.0)  # half an update...
        real_oom()  # ...then the OOM: retrying would apply the update twice

    opt.register_step_pre_hook(hook)
    x, y = data()
    with (
        pytest.raises(OutOfMemoryAbort, match="DefaultCPUAllocator"),
        Session(model, opt, mse, SessionConfig(global_batch=16, grow_after=None)) as session,
    ):
        session.step((x[:16], y[:16]))
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    failure = next(r for r in records if r["type"] == "failure")
    assert failure["kind"] == "host_oom" and failure["phase"] == "optimizer" and failure["recovered"] is False


def test_grad_scaler_state_is_reset_between_attempts() -> None:
    model, opt = make(dropout=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    failures = {"left": 1}

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if failures["left"]:  # after unscale_(): a naive retry raises "unscale_() has already been called"
            failures["left"] -= 1
            real_oom()

    opt.register_step_pre_hook(hook)
    x, y = data()
    cfg = SessionConfig(global_batch=16, grow_after=None, max_grad_norm=1.0)
    with Session(model, opt, mse, cfg, scaler=scaler) as session:
        result = session.step((x[:16], y[:16]))
    assert result.ooms == 1 and scaler.get_scale() == 2.0**8


def test_at_the_floor_it_gives_up_with_the_allocator_text() -> None:
    def always(model: nn.Module, batch: Any) -> torch.Tensor:
        real_oom()
        raise AssertionError("unreachable")

    model, opt = make()
    x, y = data()
    with pytest.raises(OutOfMemoryAbort, match="DefaultCPUAllocator: can't allocate memory"):
        Session(model, opt, always, SessionConfig(global_batch=16, min_micro_batch=4, grow_after=None)).step(
            (x[:16], y[:16])
        )


def test_other_errors_pass_through_unchanged() -> None:
    def broken(model: nn.Module, batch: Any) -> torch.Tensor:
        raise ValueError("a bug in the user's loss")

    model, opt = make()
    x, y = data()
    with pytest.raises(ValueError, match="a bug in the user's loss"):
        Session(model, opt, broken, SessionConfig(global_batch=16)).step((x[:16], y[:16]))


def test_uneven_last_micro_batch_is_weighted_exactly() -> None:
    x, y = data(n=10)
    grads = []
    for micro in (10, 4, 3):  # 10 | 4+4+2 | 3+3+3+1
        model, _ = make(dropout=0.0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        result = Session(model, sgd, mse, SessionConfig(global_batch=10, micro_batch=micro)).step((x, y))
        grads.append((result.loss, [p.detach().clone() for p in model.parameters()]))
    for loss, params in grads[1:]:
        assert abs(loss - grads[0][0]) < 1e-6
        assert all(torch.allclose(p, q, atol=1e-6, rtol=0) for p, q in zip(params, grads[0][1], strict=True))


def test_ten_ooms_in_a_row_leave_memory_at_baseline() -> None:
    """1024 = 2**10: sizes 1024 ... 2 all fail (10 OOMs), 1 succeeds. Every failed attempt holds
    32 MiB of real activations in its frames when the allocator fails; afterwards none of them is
    alive (weak references) and the resident set is back at its baseline."""
    held: list[weakref.ref[torch.Tensor]] = []

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if x.shape[0] > 1:
            activations = torch.ones(8 * 2**20)  # 32 MiB, referenced only by this frame
            held.append(weakref.ref(activations))
            model(x)
            real_oom()
        return nn.functional.mse_loss(model(x), y)

    model, opt = make(dropout=0.0)
    x, y = data(n=1024)
    session = Session(model, opt, loss_fn, SessionConfig(global_batch=1024, micro_batch=1, grow_after=None))
    session.step((x, y))  # warm-up at the size that works: optimizer state, allocator caches
    release_memory()
    probe = MemoryProbe(torch.device("cpu"))
    baseline = probe.rss()
    session.tuner.current = 1024
    session.tuner.failed.clear()
    gc.disable()  # the session's own cleanup must free them, not a collection we trigger
    try:
        result = session.step((x, y))
        alive = [ref() is not None for ref in held]
    finally:
        gc.enable()
    release_memory()
    after = probe.rss()

    assert result.ooms == 10 and result.micro_batch == 1
    assert len(alive) == 10 and not any(alive), "a failed step's tensors are still alive"
    assert after - baseline < 8 * 2**20, f"RSS grew by {(after - baseline) / 2**20:.1f} MiB after 10 OOMs"


def test_shrink_takes_the_largest_divisor_at_most_half() -> None:
    assert shrink(256, 256) == 128
    assert shrink(96, 96) == 48 and shrink(96, 48) == 24 and shrink(96, 24) == 12
    assert shrink(96, 12) == 6 and shrink(96, 6) == 3 and shrink(96, 3) == 1
    assert shrink(24, 24, floor=2) == 12 and shrink(24, 3, floor=2) is None
    assert shrink(10, 10) == 5 and shrink(10, 5) == 2  # never 4: it does not divide 10


def test_grow_skips_failed_sizes() -> None:
    assert grow(96, 12, set()) == 16 and grow(96, 12, {16, 24}) == 32 and grow(96, 96, set()) is None


def test_tuner_lifecycle() -> None:
    tuner = Tuner(per_process=64, current=64, grow_after=2)
    assert (d := tuner.on_oom()) is not None and (d.micro_batch, d.reason) == (32, "oom")
    assert tuner.on_success(1e6, 1e12) is None  # 1 stable step of 2
    grown = tuner.on_success(1e6, 1e12)
    assert grown is None, "64 failed: never tried again"
    tuner = Tuner(per_process=64, current=8, grow_after=1)
    assert (d := tuner.on_success(1000.0, 1e9)) is not None and (d.micro_batch, d.reason) == (16, "grow")
    assert (d := tuner.on_oom()) is not None and (d.micro_batch, d.reason) == (8, "grow_failed")
    assert (d := tuner.on_success(1000.0, 1e9)) is not None and d.micro_batch == 32, "16 failed: skipped"
    tuner = Tuner(per_process=64, current=8, grow_after=1)
    assert tuner.on_success(1e6, 15e6) is None, "16 x 1 MB does not fit in 85% of 15 MB"
    assert tuner.on_success(None, 1e9) is None, "no measurement, no growth"
