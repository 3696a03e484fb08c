"""The test suite's own bookkeeping: the quick loop's table of slow tests stays true."""

from __future__ import annotations

import conftest


def test_every_slow_entry_names_a_collected_test():
    # conftest.SLOW lists tests by file and name; a renamed or removed test leaves an entry that
    # marks nothing (and the test under its new name would run in the quick loop unnoticed).
    assert conftest.STALE_SLOW == [], f"tests/conftest.py SLOW names tests that do not exist: {conftest.STALE_SLOW}"
