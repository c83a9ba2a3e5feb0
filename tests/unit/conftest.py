"""The `unit` tier: in-process logic, at most a short-lived saver: seconds each."""

from tiers import tier_marks


def pytest_collection_modifyitems(config, items):
    tier_marks(items, "unit")
