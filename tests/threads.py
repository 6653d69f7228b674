"""One torch thread for tests of tiny models.

Tiny models are dominated by per-op overhead: extra threads only contend with the other test processes sharing the
machine. A test module opts in by importing the autouse fixture (pytest finds fixtures in the module's namespace)::

    from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block on one torch intra-op thread, then restore the previous count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_module() -> Iterator[None]:
    """Every test of the importing module runs on one torch thread."""
    with one_torch_thread():
        yield
