"""Drop-in Megatron-LM save_checkpoint / load_checkpoint with a storage_type argument.

Not implemented yet (tracked by its own issue); importing the functions raises ImportError.
"""

__all__: list[str] = []
