"""An Accelerate training script in the shape of Hugging Face's ``run_*_no_trainer.py`` examples and
Accelerate's ``examples/by_feature/checkpointing.py``: ``logging.basicConfig`` at INFO, a tqdm bar over
the optimizer steps, ``accelerator.save_state`` into ``step_N`` every ``--checkpointing_steps``,
``--resume_from_checkpoint`` through ``accelerator.load_state`` and ``skip_first_batches``, and
``accelerator.print`` at the end of each epoch. Used only to capture real output lines for the corpus.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm

logger = get_logger(__name__)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--checkpointing_steps", type=int, default=3)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--resume_from_checkpoint", default=None)
    args = p.parse_args()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=True)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(0)
    x = torch.randn(96, 64)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=args.per_device_train_batch_size)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps_per_epoch = len(loader) // args.gradient_accumulation_steps
    max_train_steps = args.num_train_epochs * steps_per_epoch
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(data)}")
    logger.info(f"  Num Epochs = {args.num_train_epochs}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
    logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    logger.info(f"  Total optimization steps = {max_train_steps}")
    progress_bar = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = starting_epoch = resume_step = 0
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).split("_")[1])
        starting_epoch = completed_steps // steps_per_epoch
        resume_step = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps
    progress_bar.update(completed_steps)
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0.0
        batches = accelerator.skip_first_batches(loader, resume_step) if epoch == starting_epoch else loader
        for inputs, targets in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(inputs), targets)
                total_loss += loss.item()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
        accelerator.print(f"epoch {epoch}: train_loss {total_loss / len(loader):.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
