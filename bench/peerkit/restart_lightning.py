"""A Lightning script as ``oomguard run`` supervises it (bench/restart_path.py).

``--batch-size {micro_batch} --accumulate-grad-batches {grad_accum}`` go to the DataLoader and the
``Trainer``, no ``BatchSizeFinder``: an OOM ends the process (Lightning tears down and re-raises)
and the supervisor restarts it smaller. The model and data are the benchmark's
(peerkit/workload.py), so the script writes the same records as the plain one: process start
before its imports, imports done, Trainer built, first sample drawn, each optimizer step, the
uncaught OOM and its atexit.

    python bench/peerkit/restart_lightning.py --batch-size 16 --accumulate-grad-batches 4
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: the restart split counts the interpreter and imports

import argparse  # noqa: E402
import tempfile  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


class LitGPT(L.LightningModule):
    def __init__(self, batch_size: int, dataset_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.dataset_size = dataset_size
        self.model = workload.TinyGPT()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch)["loss"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return DataLoader(workload.MarkedDataset(self.dataset_size), batch_size=self.batch_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accumulate-grad-batches", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=3)
    args = p.parse_args()
    workload.setup()
    workload.install_exit_record()
    module = LitGPT(args.batch_size, args.max_steps * args.batch_size * args.accumulate_grad_batches)
    with tempfile.TemporaryDirectory(prefix="restart-lightning-") as root:
        trainer = L.Trainer(max_steps=args.max_steps, accumulate_grad_batches=args.accumulate_grad_batches,
                            accelerator=workload.device().type, devices=1, default_root_dir=root, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        workload.mark("model")
        trainer.fit(module)


if __name__ == "__main__":
    main()
