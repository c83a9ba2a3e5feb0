"""The user's own module beside ``_warm_probe.py``: records which ``__main__`` it was imported under (a
warm worker must not import it ahead of the script)."""

import sys

MAIN_AT_IMPORT = getattr(sys.modules.get("__main__"), "__file__", None)
