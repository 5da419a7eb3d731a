"""Kernel tests: without a GPU, Triton kernels run on CPU in Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated with @triton.jit, i.e. when
``megaft.kernels.<family>.triton`` is first imported; the fronts import those
modules lazily, so setting it here, at collection, is early enough.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
