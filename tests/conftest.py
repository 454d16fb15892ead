import os

import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The flag is read when a kernel
# is defined, so it is set before any test imports fp4lab.kernels' Triton modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
