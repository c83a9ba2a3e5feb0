"""The optional C++ fast path (``csrc/fastpath.cpp``): built once per torch version, used when present.

A snapshot of thousands of small tensors spends its pause in Python: about ten attribute reads per
tensor for its signature and one ``ctypes.memmove`` call per storage. The extension does both in one
call each. It is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are needed)
into a cache directory, in a background process at low priority so training never waits for it;
until it is there, and wherever it cannot be built, the same logic runs in Python.

Environment:
    FLASHCKPT_NATIVE: ``auto`` (default: load if built, else build in the background, once: a failed
        build is remembered), ``build`` (build in this process when needed, blocking, and fail
        loudly), ``0`` (never use it). ``flashckpt native --build`` builds ahead (for images).
    FLASHCKPT_EXT_DIR: where builds are cached (default ``~/.cache/flashckpt/ext``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from types import ModuleType

import torch
from flashckpt.config import knob

__all__ = ["get", "build", "ext_dir", "status"]

log = logging.getLogger("flashckpt")

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "fastpath.cpp")
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False  # a background build was started (or could not be) by this process
_idle_until = 0.0  # no extension for now (its build failed, or it does not load): look again after this
_RECHECK_S = 30.0
_builder: subprocess.Popen[bytes] | None = None
_OFF = ("0", "off", "false", "no")
_FAILED = "BUILD-FAILED"


@functools.cache
def _tag() -> str:
    with open(_SOURCE, "rb") as f:
        src = f.read()
    h = hashlib.sha256(src + torch.__version__.encode() + sys.version.encode()).hexdigest()[:12]
    return f"flashckpt_fastpath_{h}"


def ext_dir() -> str:
    root = knob("ext_dir") or os.path.join(os.path.expanduser("~"), ".cache", "flashckpt", "ext")
    return os.path.join(root, _tag())


def _built_library(d: str, name: str) -> str | None:
    for f in os.listdir(d) if os.path.isdir(d) else []:
        if f.startswith(name) and f.endswith(".so"):
            return os.path.join(d, f)
    return None


def _import(path: str, name: str) -> ModuleType:
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build() -> ModuleType:
    """Compiles the extension (if not cached) and returns it; raises when it cannot be built, and
    leaves a marker so that later processes do not try again (``flashckpt native --build`` retries)."""
    global _module
    from torch.utils import cpp_extension

    name = _tag()
    d = ext_dir()
    os.makedirs(d, exist_ok=True)
    marker = os.path.join(d, _FAILED)
    try:
        mod = cpp_extension.load(name=name, sources=[_SOURCE], build_directory=d, extra_cflags=["-O2"],
                                 verbose=False)
    except Exception as e:
        with open(marker, "w") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        raise
    if os.path.exists(marker):
        os.unlink(marker)
    _module = mod
    return mod


def status() -> str:
    """One line on the fast path: loaded, building, cached, failed, disabled or not built."""
    mode = knob("native")
    if mode in _OFF:
        return "disabled (FLASHCKPT_NATIVE=0): the Python fallback runs"
    d = ext_dir()
    if _built_library(d, _tag()):
        return f"built: {d}"
    marker = os.path.join(d, _FAILED)
    if os.path.exists(marker):
        with open(marker) as f:
            return f"build failed ({f.read().strip()[:300]}); the Python fallback runs; retry: flashckpt native --build"
    return f"not built yet (it builds in the background on first use, into {d})"


def _start_background_build() -> None:
    global _builder
    code = "import os; os.nice(19); import flashckpt.util.native as n; n.build()"
    try:
        _builder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        log.debug("flashckpt: native fast path not built: %s", e)


def get() -> ModuleType | None:
    """The extension when it is available now; never waits for a build (except ``FLASHCKPT_NATIVE=build``,
    which builds in this process). Called on every save: when the extension is loaded it returns at
    once, and when it is not coming it looks at the file system again only every ``_RECHECK_S`` (a
    library built later by ``flashckpt native --build`` is still picked up)."""
    global _module, _tried, _idle_until, _builder
    if _module is not None:
        return _module
    if _idle_until and time.monotonic() < _idle_until:
        return None
    mode = knob("native")
    if mode in _OFF:
        return None
    with _lock:
        if _module is not None:
            return _module
        if _builder is not None:
            if _builder.poll() is None:
                return None  # still building
            _builder = None
        name = _tag()
        d = ext_dir()
        lib = _built_library(d, name)
        if lib is None and mode == "build":
            _module = build()
            return _module
        if lib is not None:
            try:
                _module = _import(lib, name)
                return _module
            except ImportError as e:
                if not _idle_until:
                    log.warning("flashckpt: the native fast path at %s does not load (%s); using Python", lib, e)
                _idle_until = time.monotonic() + _RECHECK_S
                return None
        if _tried or os.path.exists(os.path.join(d, _FAILED)):
            _idle_until = time.monotonic() + _RECHECK_S  # the build ended without a library, or failed before
            return None
        _tried = True
        _start_background_build()
        return None
