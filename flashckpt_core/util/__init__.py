"""The leaf room's utilities, importing nothing of flashckpt but ``errors`` and ``config``: lazy imports
(``lazy``), writer leases and job locks (``lease``), threaded memmove (``copy``), the C++ fast path
(``native``, over ``csrc/``), CUDA streams and pinned memory (``cuda``), ``/proc`` reads (``procfs``), durable
directory entries (``durable``), scratch dirs owned by a live process (``owned_dirs``), workers that die
with their parent (``pdeathsig``), and the record of the modules a worker imported (``module_record``).
"""
