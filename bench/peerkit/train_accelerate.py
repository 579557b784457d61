"""Accelerate's ``find_executable_batch_size``, as in its official example.

accelerate's examples/by_feature/automatic_gradient_accumulation.py (the official example that
also keeps the batch the user asked for; examples/by_feature/memory.py is the same without the
accumulation): everything that holds memory is built inside the decorated inner loop, which takes
the batch size as its first argument; ``accelerator.free_memory()`` first; the accumulation is
``observed_batch_size // batch_size``. On an OOM (accelerate/utils/memory.py,
``should_reduce_batch_size``) the decorator calls the loop again at ``int(batch_size * 0.9)``.
The integer division keeps the global batch exact only when the found size divides it.

    python bench/peerkit/train_accelerate.py --global-batch 64 --steps 20
"""

from __future__ import annotations

import time

STARTED = time.time()


import torch  # noqa: E402
import workload  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import find_executable_batch_size, set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


def main() -> None:
    args = workload.contender_args(__doc__)
    workload.setup()
    accelerator = Accelerator(cpu=workload.device().type == "cpu")
    observed_batch_size = args.global_batch
    workload.mark("model")

    @find_executable_batch_size(starting_batch_size=observed_batch_size)
    def inner_training_loop(batch_size: int) -> int:
        accelerator.free_memory()
        set_seed(workload.SEED)
        model = workload.TinyGPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        accelerator.gradient_accumulation_steps = observed_batch_size // batch_size
        loader = DataLoader(workload.TokenDataset(args.steps * observed_batch_size * 2),
                            batch_size=batch_size, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        model.train()
        steps = 0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch)["loss"]
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                if steps == args.steps:
                    break
        return batch_size

    found = inner_training_loop()
    print(f"trained at batch size {found} x accumulation {accelerator.gradient_accumulation_steps}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
