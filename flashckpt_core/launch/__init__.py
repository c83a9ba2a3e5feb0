"""Starting a job: ``flashckpt-run`` (``launcher``: the node's saver first, then torchrun's agent) and its
warm workers (``warm``, ``warm_worker``: the next attempt's interpreter with the modules already imported).
The top of the core: may import every room.
"""
