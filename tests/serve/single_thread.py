"""A fixture the serve tests share (import it into a test module to use it there)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread in this process (the servers run with --threads 1 too): two OpenMP threads on a busy 2-core
    machine spin while they wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
