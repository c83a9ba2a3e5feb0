"""Snapshots in shared memory, trainer side: the snapshot plan (``plan``), the writer (``writer``:
flatten, plan, pick a slot, copy, complete), its device-to-host copies (``device``) and writer lease
(``writer_lease``), and the reader (``reader``, the public ``SnapshotReader``); the writer has a reader.
Imports the rooms below (leaf, format, storage, commit, transport); never the engine.
"""
