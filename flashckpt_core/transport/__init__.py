"""The wire between processes: framing over sockets and pipes and the ``Client`` (``wire``), typed
messages (``messages``), DLRover-style shared objects over the saver (``ipc``), the trainer's link to its
node's saver (``link``), starting a saver by module name without importing it (``spawn``), and the peers of
a multi-node job (``peers``). Imports the leaf, format, storage and commit rooms only; never the saver.
"""
