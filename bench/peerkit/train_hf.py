"""Hugging Face Trainer with ``auto_find_batch_size=True``, as its documentation shows it.

``TrainingArguments(per_device_train_batch_size=N, auto_find_batch_size=True)``: Trainer.train()
wraps its inner training loop in ``find_executable_batch_size`` (transformers/trainer_utils.py,
which defers to accelerate.utils.memory): on an OOM (``should_reduce_batch_size``: the text
"DefaultCPUAllocator: can't allocate memory" or " out of memory.") it frees memory and starts the
whole loop again at ``int(batch_size * 0.9)``. ``gradient_accumulation_steps`` stays what it was,
so the global batch shrinks with the micro-batch (read in trainer.py: ``_update_auto_batch_size``
only sets ``_train_batch_size``).

    python bench/peerkit/train_hf.py --global-batch 64 --steps 20
"""

from __future__ import annotations

import time

STARTED = time.time()

import tempfile  # noqa: E402

import workload  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


def main() -> None:
    args = workload.contender_args(__doc__)
    workload.setup()
    with tempfile.TemporaryDirectory(prefix="peers-hf-") as out:
        training_args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.global_batch,  # one device, no accumulation: global = this
            gradient_accumulation_steps=1,
            auto_find_batch_size=True,
            max_steps=args.steps,
            learning_rate=3e-4,
            lr_scheduler_type="constant",
            weight_decay=0.01,
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            use_cpu=workload.device().type == "cpu",
            seed=workload.SEED,
        )
        model = workload.TinyGPT()
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=workload.TokenDataset(args.steps * args.global_batch))
        workload.mark("model")
        trainer.train()
        print(f"trained at per-device batch {trainer._train_batch_size}", flush=True)


if __name__ == "__main__":
    main()
