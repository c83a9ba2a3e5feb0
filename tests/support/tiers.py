"""The test tiers: one folder each under tests/, whose conftest.py marks its tests with ``tier_marks``."""

from __future__ import annotations

import os

TIERS = ("unit", "multiproc", "framework", "conformance", "gpu")


def tier_marks(items: list, tier: str) -> None:
    """Marks the tests of one tier folder (called by that folder's conftest.py): ``tier``, unless a ``unit``
    test carries another tier's marker."""
    for item in items:
        if os.path.basename(os.path.dirname(str(item.path))) != tier:
            continue
        others = [t for t in TIERS if t != tier and item.get_closest_marker(t)]
        if not (tier == "unit" and others):
            item.add_marker(tier)
