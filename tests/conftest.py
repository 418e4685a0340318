import os

import torch

# Without a GPU, Triton kernels run in its interpreter (numpy). The switch is read when
# @triton.jit decorates, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
