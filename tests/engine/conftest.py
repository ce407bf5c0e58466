"""Checks shared by the engine tests.

NOTE: tests reach these through fixtures, not ``from conftest import ...``:
every conftest.py outside a package is the module ``conftest``, so that import
breaks as soon as pytest loads another directory's conftest in the same run.
"""

from __future__ import annotations

import pytest

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
