"""The plain-PyTorch cases of the probe's matrix (tests/e2e/test_probe_matrix.py): a tiny GPT-style model
trained a few steps from a fixed seed, in the mode ``--case`` names. Writes matrix_report's file."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from matrix_report import Steps
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, SEQ, BATCH = 64, 32, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.mlp(x)


class LM(nn.Module):
    def __init__(self, checkpoint: str = "", blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.checkpoint = checkpoint

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def batch(step: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(step_fn: Callable[[int], Any], steps: int, out: Steps) -> None:
    for step in range(steps):
        out.start()
        out.done(step_fn(step))


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, forward: Callable[..., Any] | None = None,
               seqs: Callable[[int], int] = lambda _: SEQ) -> Callable[[int], Any]:
    forward = model if forward is None else forward

    def step(i: int) -> Any:
        loss = forward(*batch(i, seqs(i)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def compiled_opt_case(steps: int, out: Steps) -> None:
    model = LM(blocks=1)  # dynamo traces the optimizer per parameter: fewer, a shorter compile
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_step = torch.compile(opt.step, backend="aot_eager")  # dynamo's side is what the probe meets

    def step(i: int) -> Any:
        loss = model(*batch(i))
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        return loss

    train(step, steps, out)


def func_case(steps: int, out: Steps) -> None:
    """torch.func: a functional model, gradients by ``grad``, an SGD update by hand (no optimizer)."""
    model = LM()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor], idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (idx, targets))

    grad_fn = torch.func.grad_and_value(loss_fn)

    def step(i: int) -> Any:
        nonlocal params
        grads, loss = grad_fn(params, *batch(i))
        params = {k: v - 0.05 * grads[k] for k, v in params.items()}
        return loss

    train(step, steps, out)


def amp_case(steps: int, out: Steps) -> None:
    """CPU autocast to bfloat16 with a GradScaler; step 2's gradients are made inf, so it is skipped."""
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skipped = []

    def step(i: int) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*batch(i))
        scaler.scale(loss).backward()
        if i == 2:
            model.head.bias.grad.fill_(float("inf"))  # an overflow: the scaler skips optimizer.step
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(i)
        opt.zero_grad(set_to_none=True)
        return loss

    train(step, steps, out)
    out.write(skipped=skipped, optimizer_steps=steps - len(skipped))


def two_case(steps: int, out: Steps) -> None:
    """Two models and two optimizers stepped in one iteration (a GAN's shape)."""
    first, second = LM(), LM()
    opts = [torch.optim.AdamW(first.parameters(), lr=1e-3), torch.optim.SGD(second.parameters(), lr=0.05)]

    def step(i: int) -> Any:
        loss = first(*batch(i)) + second(*batch(i + 100))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    train(step, steps, out)


# fullgraph and dynamic go through aot_eager: what the probe meets is dynamo's tracing (the same for
# every backend); inductor's code generation would only add minutes to CI (it has its own cases).
class Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, targets = batch(index)
        return idx[0], targets[0]


def loader_case(steps: int, out: Steps, context: str) -> None:
    """Batches from a DataLoader worker started by ``context`` (fork or spawn): it imports torch and
    gets the probe too, and never steps."""
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, num_workers=1, multiprocessing_context=context)
    data = iter(loader)

    def step(_: int) -> Any:
        loss = model(*next(data))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    train(step, steps, out)


COMPILES: dict[str, dict[str, Any]] = {
    "compile": {}, "fullgraph": {"fullgraph": True, "backend": "aot_eager"},
    "dynamic": {"dynamic": True, "backend": "aot_eager"}, "max_autotune": {"mode": "max-autotune-no-cudagraphs"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = Steps()
    special = {"compiled_opt": compiled_opt_case, "func": func_case, "amp": amp_case, "two": two_case,
               "loader_fork": loader_case, "loader_spawn": loader_case}
    if args.case in special:
        if args.case.startswith("loader_"):
            loader_case(args.steps, out, args.case.removeprefix("loader_"))
        else:
            special[args.case](args.steps, out)
        if args.case != "amp":
            out.write()
        return
    checkpoint = args.case.removeprefix("ckpt_") if args.case.startswith("ckpt_") else ""
    # One block: a shorter compile. None under max-autotune, which benchmarks kernel choices for every
    # matmul of the forward and the backward: the head's are enough to meet the mode, and a block adds four more.
    blocks = {"max_autotune": 0}.get(args.case, 1 if args.case in COMPILES else 2)
    model = LM(checkpoint, blocks=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model, **COMPILES[args.case]) if args.case in COMPILES else model
    seqs = (lambda i: SEQ + 2 * (i % 3)) if args.case == "dynamic" else (lambda _: SEQ)  # shapes that vary
    train(plain_step(model, opt, forward, seqs), args.steps, out)
    out.write()


if __name__ == "__main__":
    main()
