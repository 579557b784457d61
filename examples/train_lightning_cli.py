"""A LightningCLI script as people write them, supervised by oomguard without a change.

It prints nothing itself: what reaches the output is Lightning's own (its progress bar, Rich when
``rich`` is installed, its warnings), and Lightning's default ``ModelCheckpoint`` writes
``lightning_logs/version_N/checkpoints/epoch=E-step=S.ckpt`` once per epoch, keeping the newest.
A small MLP on synthetic data, CPU. With ``--model.memory_budget_mb`` the process gets a host memory
budget (RLIMIT_AS) once step ``--model.budget_from_step`` is done: a micro-batch too large for it then
fails in PyTorch's real allocator (``DefaultCPUAllocator: can't allocate memory``) after a checkpoint
exists. With ``--model.compile true`` the module compiles its network in ``configure_model`` (the hook
Lightning runs before the optimizers are configured, where its docs apply ``torch.compile``).

    oomguard run --micro-batch 16 --global-batch 32 \\
        --checkpoint 'lightning_logs/version_*/checkpoints/*.ckpt' --resume-args '--ckpt_path {checkpoint}' -- \\
        python examples/train_lightning_cli.py fit --data.batch_size {micro_batch} \\
        --trainer.accumulate_grad_batches {grad_accum} --model.memory_budget_mb 16
"""

from __future__ import annotations

import ctypes
import resource

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn


class TinyRegressor(L.LightningModule):
    """An MLP over (batch, tokens, features) inputs: each sample's activations take a few MiB."""

    def __init__(self, features: int = 256, hidden: int = 1024, lr: float = 1e-3, memory_budget_mb: int = 0,
                 budget_from_step: int = 4, compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, features))
        self.budget_set = False
        self.stepped = False  # an optimizer step ran in this process: its state exists before the budget

    def configure_model(self) -> None:
        if self.hparams["compile"] and not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net)  # the same parameters: the optimizer and checkpoints see them

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), prog_bar=True)

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.stepped = True

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        """Allow the address space in use after step N (and one optimizer step in this process, so a
        resumed attempt has its optimizer state) plus the budget: allocations beyond it fail."""
        budget = self.hparams["memory_budget_mb"]
        if self.budget_set or not budget or not self.stepped or self.global_step < self.hparams["budget_from_step"]:
            return
        vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
        limit = vm_kb * 1024 + budget * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        self.budget_set = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class SyntheticData(L.LightningDataModule):
    """Deterministic random samples: sample i is the same in every attempt."""

    def __init__(self, batch_size: int = 8, samples: int = 128, val_samples: int = 0, tokens: int = 128,
                 features: int = 256) -> None:
        super().__init__()
        self.batch_size, self.samples, self.val_samples = batch_size, samples, val_samples
        self.tokens, self.features = tokens, features

    def _loader(self, samples: int, seed: int) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
        x = torch.randn(samples, self.tokens, self.features, generator=torch.Generator().manual_seed(seed))
        data = torch.utils.data.TensorDataset(x, x.roll(1, dims=-1))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
        return self._loader(self.samples, 0)

    def val_dataloader(self) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]] | list[object]:
        return self._loader(self.val_samples, 1) if self.val_samples else []


def fixed_mmap_threshold() -> None:
    """Large blocks from mmap, returned to the system when freed: glibc otherwise raises its mmap
    threshold as blocks are freed and keeps later ones in the heap, so the address space left under
    the budget would depend on the history of the process, not on the micro-batch."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it ends the dynamic rise
    except OSError:
        pass  # not glibc: the budget is only less exact


def main() -> None:
    torch.set_num_threads(1)
    fixed_mmap_threshold()
    LightningCLI(TinyRegressor, SyntheticData, seed_everything_default=0,
                 trainer_defaults={"accelerator": "cpu", "devices": 1, "max_epochs": 3})


if __name__ == "__main__":
    main()
