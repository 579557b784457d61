"""The texts by which libraries report an allocation failure, shared by both classifiers.

The supervisor reads them in the worker's output (``supervisor.observe.output``); the worker library
reads them in an exception's message (``worker.outofmemory``). One definition keeps the two from drifting
apart. Every form here has a line in tests/data/oom_corpus.jsonl, taken from the source of the
library that prints it (docs/oom-messages.md lists them). Standard library only: the supervisor
imports this module and must not import torch.
"""

from __future__ import annotations

import re

# Out of memory on the accelerator (CUDA, ROCm/HIP, Apple MPS, Intel XPU), where halving the
# micro-batch helps: PyTorch's caching allocators, the CUDA runtime's error string behind
# C10_CUDA_CHECK / C10_HIP_CHECK, cuBLAS and cuDNN failing to allocate their workspace, and NCCL
# failing a cudaMalloc for its buffers.
DEVICE_OOM = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|CUDA driver error: out of memory"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"
    r"|HIP out of memory|hipErrorOutOfMemory|HIP error: out of memory"
    r"|MPS backend out of memory|XPU out of memory"
    r"|Cuda failure (?:\d+ )?'out of memory'"
)
# PyTorch's host allocator, in both wordings: POSIX (posix_memalign failed) and Windows/Android
# (``[enforce fail at alloc_cpu.cpp:114] . DefaultCPUAllocator: not enough memory``).
HOST_OOM = re.compile(r"DefaultCPUAllocator: (?:can't allocate|not enough) memory")
