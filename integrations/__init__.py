"""Thin adapters of flashckpt to training frameworks; each imports its framework lazily."""
