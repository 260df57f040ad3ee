"""Shared test fixtures."""

import os
import zlib

import pytest
import torch

# Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before anything (e.g.
# diffusers through torch._dynamo) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def seeded_torch(request):
    """Seed torch from the test id: every test draws fresh data, and a failure reproduces exactly."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))

