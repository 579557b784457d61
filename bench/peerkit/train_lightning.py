"""Lightning's ``BatchSizeFinder`` callback, then ``fit``, as its documentation shows it.

``Trainer(callbacks=[BatchSizeFinder()])`` runs the finder at the start of ``fit``
(lightning/pytorch/tuner/batch_size_scaling.py): it saves a checkpoint, sets the module's
``batch_size`` to ``init_val`` (2) and, in the default ``power`` mode, doubles it after every trial
of ``steps_per_trial`` (3) real optimizer steps until an OOM (``is_oom_error``: the CUDA text or
"DefaultCPUAllocator: can't allocate memory"); it keeps the last size that worked, restores the
checkpoint (the trial steps are thrown away) and fits at that size. The batch the module asked
for is overwritten: the finder looks for the largest power of two that fits, not for the batch
the user chose, and ``accumulate_grad_batches`` stays as it was.

    python bench/peerkit/train_lightning.py --global-batch 64 --steps 20
"""

from __future__ import annotations

import time

STARTED = time.time()

import tempfile  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
from lightning.pytorch.callbacks import BatchSizeFinder  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


class LitGPT(L.LightningModule):
    def __init__(self, batch_size: int, dataset_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size  # the attribute BatchSizeFinder scales
        self.dataset_size = dataset_size
        self.model = workload.TinyGPT()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch)["loss"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return DataLoader(workload.TokenDataset(self.dataset_size), batch_size=self.batch_size, shuffle=True)


def main() -> None:
    args = workload.contender_args(__doc__)
    workload.setup()
    module = LitGPT(args.global_batch, args.steps * args.global_batch * 2)
    with tempfile.TemporaryDirectory(prefix="peers-lightning-") as root:
        trainer = L.Trainer(
            max_steps=args.steps,
            accelerator=workload.device().type,
            devices=1,
            callbacks=[BatchSizeFinder()],
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        workload.mark("model")
        trainer.fit(module)
    print(f"trained at batch size {module.batch_size}", flush=True)


if __name__ == "__main__":
    main()
