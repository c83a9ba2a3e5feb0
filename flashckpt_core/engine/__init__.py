"""The trainer's side: ``CheckpointEngine`` (``engine``) as a facade over its parts: the save policy
(``interval``), the copy into memory (``snapshot``), the conversation with the saver (``session``),
deletions (``deletions``), locating and loading (``restore``, ``loader``, ``remote_load``), agreement
across ranks and nodes (``agreement``), who may call (``guard``) and where a process sits (``ranks``).
``adapter`` holds the load protocol every framework adapter follows (``resolve_load``), ``collective``
the collectives they share (errors gathered from every rank into one exception) and ``routing`` their
path rules. Imports every room below; never the saver or the launcher.
"""
