import os

import torch

# Without a GPU the Triton kernels run in the interpreter (CPU tier). The variable must be set
# before triton is imported, which the kernels module does lazily.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The C++ host layer (csrc/host) serves the whole tier, also on a CPU build of torch, where it is
# off by default: its checks and autograd formulas run for every device. tests/test_host.py runs
# the package with it off.
os.environ.setdefault("COMPILED_MOE_HOST", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
