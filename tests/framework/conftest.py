"""The `framework` tier: a real framework (transformers, Lightning, DeepSpeed, FSDP, Megatron) under the adapter."""

from tiers import tier_marks


def pytest_collection_modifyitems(config, items):
    tier_marks(items, "framework")
