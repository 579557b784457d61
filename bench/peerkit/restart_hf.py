"""A Hugging Face Trainer script as ``oomguard run`` supervises it (bench/restart_path.py).

The Trainer's own arguments carry the batch (``--per_device_train_batch_size {micro_batch}
--gradient_accumulation_steps {grad_accum}``), no ``auto_find_batch_size``: an OOM ends the
process and the supervisor restarts it smaller. The model and data are the benchmark's
(peerkit/workload.py), so the script writes the same records as the plain one: process start
before its imports, imports done, Trainer built, first sample drawn, each optimizer step, the
uncaught OOM and its atexit.

    python bench/peerkit/restart_hf.py --per_device_train_batch_size 16 --gradient_accumulation_steps 4
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: the restart split counts the interpreter and imports

import argparse  # noqa: E402
import tempfile  # noqa: E402

import workload  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per_device_train_batch_size", type=int, required=True)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=3)
    args = p.parse_args()
    workload.setup()
    workload.install_exit_record()
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    with tempfile.TemporaryDirectory(prefix="restart-hf-") as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.max_steps,
            learning_rate=3e-4, lr_scheduler_type="constant", save_strategy="no", logging_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            use_cpu=workload.device().type == "cpu", seed=workload.SEED)
        trainer = Trainer(model=workload.TinyGPT(), args=training_args,
                          train_dataset=workload.MarkedDataset(args.max_steps * global_batch))
        workload.mark("model")
        trainer.train()


if __name__ == "__main__":
    main()
