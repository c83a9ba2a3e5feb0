"""Python values in a persisted file exactly as a trainer pickled them, written by a process that never
unpickles them.

A trainer pickles each opaque leaf of a state dict (a ``set``, an ``argparse.Namespace``, a user's class;
``_tree.encode_opaque``, protocol 2 as ``torch.save`` uses) and checks that the pickle loads under its
``weights_only`` rules. The persist worker holds those pickles as ``RawPickle`` leaves of the tree it gives
``torch.save``, and ``SplicingPickler`` (torch.save's pickler then, through ``pickle_module``) writes each
one's opcodes straight into the stream, as if it had pickled the object itself: the inner pickle's PROTO and
STOP left out and its memo indexes moved past the outer pickler's. The file then holds the object as
``torch.save`` of it would (``torch.load(weights_only=True)`` reads it under the same safe globals the
trainer had), and nothing in the worker ever unpickles a user's object.

``SplicingPickler`` is the pure-Python pickler (``pickle._Pickler``): used only for trees that hold opaque
leaves; every other tree is pickled by the C pickler as before.

``EMPTY_BYTES`` stands for ``b""``: pickle protocol 2 writes every other bytes value as
``_codecs.encode(text, "latin1")``, which ``torch.load(weights_only=True)`` reads, but ``b""`` as a call of
``builtins.bytes``, which it refuses; the stand-in (a ``bytes`` equal to ``b""``) pickles as
``_codecs.encode("", "latin1")``.
"""

from __future__ import annotations

import codecs
import pickle
import pickletools
import struct
from typing import Any

from flashckpt import errors as E

__all__ = ["RawPickle", "SplicingPickler", "EMPTY_BYTES", "splice"]


class RawPickle:
    """A value as its protocol-2 pickle (``data``), to be written into a file unread (``SplicingPickler``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> Any:
        raise E.PersistError("a RawPickle is written by SplicingPickler only (torchfile.torch_save_parts with "
                             "raw_pickles=True)")


class _EmptyBytes(bytes):
    """``b""`` that pickles as ``_codecs.encode("", "latin1")`` (see the module docstring)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (codecs.encode, ("", "latin1"))


EMPTY_BYTES: bytes = _EmptyBytes()

_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
_GETS = ("GET", "BINGET", "LONG_BINGET")
_UNSPLICEABLE = ("FRAME", "MEMOIZE")  # protocol 4+: framing, and memo indexes that are not in the stream


def _memo_op(kind: bytes, long_kind: bytes, idx: int) -> bytes:
    return kind + bytes((idx,)) if idx < 256 else long_kind + struct.pack("<I", idx)


def splice(data: bytes, base: int) -> tuple[bytes, int]:
    """The opcodes of the protocol-2 pickle ``data`` without its PROTO and STOP, with every memo index moved
    up by ``base``; and how many memo indexes it uses (the outer pickler's memo must skip them).

    Raises:
        PersistError: ``data`` is not a complete protocol-2 pickle (only these are spliced; the opcodes of
            later protocols are not what ``torch.save`` writes).
    """
    out = bytearray()
    used = 0
    try:
        ops = list(pickletools.genops(data))
    except Exception as e:
        raise E.PersistError(f"an opaque leaf's pickle is damaged ({type(e).__name__}: {e})") from e
    if not ops or ops[0][0].name != "PROTO" or ops[0][1] != 2 or ops[-1][0].name != "STOP":
        raise E.PersistError("an opaque leaf's pickle is not a whole protocol-2 pickle")
    for k in range(1, len(ops) - 1):
        op, arg, pos = ops[k]
        name = op.name
        if name in _PUTS:
            idx: int = arg  # type: ignore[assignment]  # (an int for these opcodes)
            out += _memo_op(pickle.BINPUT, pickle.LONG_BINPUT, base + idx)
            used = max(used, idx + 1)
        elif name in _GETS:
            idx = arg  # type: ignore[assignment]
            out += _memo_op(pickle.BINGET, pickle.LONG_BINGET, base + idx)
        elif name in _UNSPLICEABLE:
            raise E.PersistError(f"an opaque leaf's pickle holds {name}, which protocol 2 does not write")
        else:
            out += data[pos:ops[k + 1][2]]
    return bytes(out), used


_PythonPickler: Any = pickle._Pickler  # the pure-Python pickler


class SplicingPickler(_PythonPickler):
    """A pure-Python pickler (protocol 2) that writes each ``RawPickle`` leaf as its own opcodes (``splice``)
    instead of pickling it. One instance per ``dump``, on one thread."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if type(obj) is RawPickle:
            if self.proto != 2:
                raise E.PersistError(f"RawPickle leaves are written at protocol 2, not {self.proto}")
            ops, used = splice(obj.data, len(self.memo))
            self.write(ops)
            for _ in range(used):  # the indexes the spliced PUTs took: the next memoized object gets the one after
                hold = object()
                self.memo[id(hold)] = (len(self.memo), hold)
            return
        super().save(obj, save_persistent_id)
