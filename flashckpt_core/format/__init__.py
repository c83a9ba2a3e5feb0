"""How a checkpoint looks in bytes, with no I/O policy: a state dict as a skeleton plus tensors and
opaque leaves (``tree``, ``tensormeta``), filling a caller's tensors (``into``), ``torch.save`` files as
parts (``torchfile``, ``rawpickle``, ``rawio``), direct-I/O writes of such files (``filewriter``),
multi-file checkpoints (``files``: ``FileSet``), the shared-memory segment format (``segment``) and the
reserved names (``names``). Imports only the leaf room (``errors``, ``config``, ``util``).
"""
