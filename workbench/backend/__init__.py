"""The rank side: everything here runs inside a torchrun rank (torch, megatron-core, CUDA)."""

from workbench.kernels import te_status

if te_status()[0] == "ok":
    # Transformer Engine's core library loads cuDNN from the system's library path when it is imported
    # (by megatron-core), and torch loads its own bundled cuDNN only on first use: after TE, torch would
    # find the system's (older) copy, refuse it in torch.backends.cudnn and run SDPA on it.  Loading
    # torch's own first keeps torch, and TE (same soname), on it.
    import torch

    if torch.cuda.is_available():
        try:
            torch.backends.cudnn.version()
        except RuntimeError:  # already too late (TE imported first): nothing to fix here
            pass
