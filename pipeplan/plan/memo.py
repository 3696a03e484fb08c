"""Memoised pure steps of the planner, for the length of one search.

The cluster search calls the pipeline planner once per (d, t, p, ZeRO, recomputation family),
and each call builds the same layer graphs, solves many of the same chain partitions and costs
the same splits again. Inside :func:`planning_cache` those three pure functions remember their
results, keyed by their inputs' values (and by identity for the profile and the graph, whose
objects the cache holds so that an identity cannot be reused); outside it nothing is kept, so
a caller that changes a profile in place between two plans never sees a stale result.
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["planning_cache", "memoised"]

_tables: dict | None = None


@contextmanager
def planning_cache():
    """Remember graphs, partitions and stage costs until the outermost ``with`` ends."""
    global _tables
    if _tables is not None:  # nested: the outer search's cache serves
        yield
        return
    _tables = {}
    try:
        yield
    finally:
        _tables = None


def memoised(kind: str, key, keep: tuple, compute):
    """``compute()``, or its remembered value for ``(kind, key)`` while a cache is active.

    ``key`` holds values (and ``id()`` of the objects in ``keep``); ``keep`` is checked by
    identity so that a recycled ``id`` never matches.
    """
    if _tables is None:
        return compute()
    table = _tables.setdefault(kind, {})
    hit = table.get(key)
    if hit is not None and len(hit[0]) == len(keep) and all(a is b for a, b in zip(hit[0], keep)):
        return hit[1]
    value = compute()
    table[key] = (keep, value)
    return value
