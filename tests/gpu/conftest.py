"""The `gpu` tier: CUDA paths; skipped without a GPU (scripts/gpu.sh runs them on a lent machine)."""

from tiers import tier_marks


def pytest_collection_modifyitems(config, items):
    tier_marks(items, "gpu")
