"""The `conformance` tier: the frameworks' own checkpoint test suites (vendored, unmodified), vanilla and with flashckpt."""

from tiers import tier_marks


def pytest_collection_modifyitems(config, items):
    tier_marks(items, "conformance")
