"""The `multiproc` tier: savers, persist workers, trainers and launchers in processes of their own, faults and kills; the S3 backend against a
real S3-compatible server on loopback; simulated nodes (mount namespaces) and node loss; issue #30's process events,
values, identities and dirs that move."""

from tiers import tier_marks


def pytest_collection_modifyitems(config, items):
    tier_marks(items, "multiproc")
