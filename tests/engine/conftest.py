"""Checks shared by the engine tests.

NOTE: tests reach these through fixtures, not ``from conftest import ...``:
every conftest.py outside a package is the module ``conftest``, so that import
breaks as soon as pytest loads another directory's conftest in the same run.
"""

from __future__ import annotations

import pytest
import torch

from engine.scheduler import Scheduler


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """Nothing waits or runs, and no KV block or block table is left behind."""
    assert scheduler.num_waiting == 0
    assert scheduler.num_running == 0
    assert not scheduler.has_unfinished_requests()
    kv = scheduler.kv_cache
    assert kv.num_requests == 0
    stats = kv.stats
    assert stats.num_blocks_used == 0
    assert stats.usage == 0.0
    assert kv.num_free_blocks == stats.num_blocks_total


@pytest.fixture(name="assert_scheduler_empty")
def assert_scheduler_empty_fixture():
    """:func:`assert_scheduler_empty`, handed to a test."""
    return assert_scheduler_empty


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's model steps on one intra-op thread.

    NOTE: the steps here are tiny (a few tokens), so a second thread gains
    little, while on a shared 2-core machine OpenMP threads that spin for a busy
    core make every step several times slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
