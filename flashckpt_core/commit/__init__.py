"""Commit policy over a storage backend: the layout of a checkpoint dir and its queries (``layout``),
the commit protocol (``protocol``: done markers, manifest, tracker; repair), deletions (``removal``),
manifests (``manifest``), where the commit records live and how a job holds them (``records_home``; on
POSIX ``records_store``, ``records_read``, ``records_upkeep``), readying a dir and what lies inside it
(``checkpoint_dir``), retention strategies (``retention``) and dirs whose records did not come along
(``adopt``). Imports the leaf, format and storage rooms only.
"""
