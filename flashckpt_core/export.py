"""``flashckpt export``: a committed step (or a snapshot in this node's memory) as Hugging Face safetensors
or one ``torch.save`` file, for serving, evaluation or sharing, without the training code.

What a step holds decides how it is read, each time with the framework's own reader (this module is glue):

- the HF Trainer's ``checkpoint-N`` (``model.safetensors``, its shards and index, ``pytorch_model.bin``):
  ``safetensors`` / ``torch.load``; its ``config.json`` (and generation and adapter configs) is copied beside
  the exported weights, so that ``from_pretrained(OUT)`` loads them;
- a DCP checkpoint (``FsdpShardCheckpointer``, megatron-core ``torch_dist``: ``.metadata`` + ``*.distcp``):
  PyTorch's own consolidation (what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does);
- a DeepSpeed tag (``mp_rank_*_model_states.pt``): with ZeRO partitions,
  ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (the fp32 weights), else the
  model states file's ``module``;
- the engine's own file (``CheckpointEngine.save`` of a state dict): the engine's loader.

Of the state read, the model's weights are exported: the sub-tree ``key`` names (dotted), by default the
first of ``model``, ``module``, ``state_dict`` the top level holds, else the whole state; ``strip_prefix``
takes a prefix such as ``module.`` off its keys. Safetensors holds tensors only: nested keys are joined with
dots and other leaves are left out (``Exported.dropped``); the torch format saves the sub-tree as it is.
Safetensors files, sharded past ``max_shard_size`` with their ``model.safetensors.index.json``, are written
by ``huggingface_hub.save_torch_state_dict`` (which also keeps one name of tensors that share memory).

The export is written beside ``out`` and renamed into place: a failed export leaves nothing at ``out``.
The checkpoint is only read. Nothing here is collective: run it in one process, where the files are local
(or, ``from_memory``, on the node whose shared memory holds the snapshot).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.registry import checkpoint_location, storage_for
from flashckpt.util.progress import bar as progress_bar

if TYPE_CHECKING:
    import torch

# torch, the engine's loader and the memory reader are imported where they are used: `flashckpt` (cli.py)
# builds its command line from ``add_parser`` and its other commands start without torch.

__all__ = ["Exported", "export_step", "add_parser", "cmd_export", "FORMATS", "MODEL_KEYS"]

FORMATS = ("safetensors", "torch")
#: the sub-trees that hold a model's weights, in the order the default ``key`` looks for them: FSDP/DCP
#: adapters and most loops (``model``), DeepSpeed and DDP (``module``), Lightning (``state_dict``)
MODEL_KEYS = ("model", "module", "state_dict")
#: files of an HF checkpoint copied beside exported safetensors, so that ``from_pretrained(OUT)`` works
_HF_CONFIGS = ("config.json", "generation_config.json", "adapter_config.json")
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
_DS_MODEL = re.compile(r"^(?:.*/)?mp_rank_\d+_model_states\.pt$")
_DS_ZERO = re.compile(r"^(?:.*/)?(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")


@dataclass(frozen=True)
class Exported:
    """What ``export_step`` wrote.

    Attributes:
        step: the step exported.
        kind: what the step held: "hf", "dcp", "deepspeed" or "engine".
        source: "storage" (a committed step) or "memory" (a snapshot in this node's shared memory).
        key: the sub-tree exported ("" for the whole state).
        paths: the files written (under ``out`` for safetensors; ``out`` itself for the torch format).
        tensors: how many tensors were exported.
        dropped: the non-tensor leaves left out of a safetensors export.
    """

    step: int
    kind: str
    source: str
    key: str
    paths: list[str]
    tensors: int
    dropped: list[str] = field(default_factory=list)


@dataclass
class _Read:
    """A step as read: its state, what kind of checkpoint it was, and the HF configs to copy."""

    step: int
    kind: str
    state: Any
    configs: list[str] = field(default_factory=list)


def export_step(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
                format: str = "safetensors", max_shard_size: str | int = "5GB", from_memory: bool = False,
                key: str | None = None, strip_prefix: str | None = None, rank: int = 0,
                weights_only: bool = True, progress: bool | None = None) -> Exported:
    """Exports the model weights of a checkpoint (see the module docstring for what is read and how).

    Args:
        checkpoint_dir: the checkpoint dir (the HF Trainer's output dir, the engine's or an adapter's dir).
        out: safetensors: the directory to create; torch: the file to create. Must not exist.
        step: the committed step (or, ``from_memory``, the snapshot) to export; default the newest.
        format: "safetensors" or "torch".
        max_shard_size: safetensors shards' size bound ("5GB", "100MB" or bytes); a larger state is sharded,
            with ``model.safetensors.index.json``.
        from_memory: export a snapshot in this node's shared memory (held by a running job, or by its saver
            after it) instead of a committed step.
        key: the dotted sub-tree to export; None: the first of ``MODEL_KEYS`` present, else the whole
            state; "": the whole state.
        strip_prefix: taken off the exported keys that start with it (``module.``, ``_orig_mod.``).
        rank: the rank whose state an engine or HF step exports (a DCP or DeepSpeed step holds every
            rank's).
        weights_only: ``torch.load(weights_only=...)`` for the files read; False only for a trusted
            checkpoint that holds Python objects.
        progress: a tqdm bar on stderr; None: when stderr is a terminal.

    Returns:
        What was written (``Exported``).

    Raises:
        InvalidArgumentError: a bad format, shard size or key, or a checkpoint this cannot export.
        AlreadyExistsError: ``out`` exists.
        CheckpointNotFoundError: no such committed step (or snapshot in memory).
    """
    fmt = _check_args(out, format, max_shard_size, rank)
    out = os.path.abspath(os.fspath(out))
    loc = checkpoint_location(checkpoint_dir, "flashckpt export")
    with contextlib.ExitStack() as stack:
        if from_memory:
            read = _read_memory(loc, step, rank, weights_only, stack)
        else:
            read = _read_committed(CommitLayout(loc, storage_for(loc)), step, rank, weights_only)
        chosen, tree = _select(read.state, key)
        if strip_prefix:
            tree = _strip(tree, strip_prefix)
        return _write(read, tree, chosen, out, fmt, max_shard_size, progress,
                      "memory" if from_memory else "storage")
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow exceptions


def _check_args(out: str | os.PathLike[str], fmt: str, max_shard_size: str | int, rank: int) -> str:
    """Refuses bad arguments before anything is read (``InvalidArgumentError``, ``AlreadyExistsError``)."""
    if fmt not in FORMATS:
        raise E.InvalidArgumentError(f"export: format {fmt!r} is not one of {', '.join(FORMATS)}")
    if not isinstance(rank, int) or rank < 0:
        raise E.InvalidArgumentError(f"export: rank {rank!r} is not a rank (0, 1, ...)")
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)
        why = "" if size > 0 else "not positive"
    except (ValueError, TypeError) as e:
        why = str(e)
    if why:
        raise E.InvalidArgumentError(f"export: max_shard_size {max_shard_size!r} is not a size such as "
                                     f"'5GB', '200MB' or a byte count ({why})")
    path = os.fspath(out)
    if os.path.lexists(path):
        raise E.AlreadyExistsError(f"export: {path} exists; name a new {'directory' if fmt == 'safetensors' else 'file'} "
                                   "(the export never overwrites)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise E.InvalidArgumentError(f"export: {parent} (where {path} would go) is not a directory; create it first")
    return fmt


# ----------------------------------------------------------------------------------------------- reading
def _read_committed(layout: CommitLayout, step: int | None, rank: int, weights_only: bool) -> _Read:
    """The state of committed ``step`` (default the newest), read by what its files are."""
    steps = layout.committed_steps()
    if not steps:
        raise E.CheckpointNotFoundError(f"export: {layout.root} holds no committed step (`flashckpt ls "
                                        f"{layout.root}` lists what it holds; --from-memory exports a snapshot "
                                        "in this node's memory)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise E.CheckpointNotFoundError(f"export: step {step} is not committed in {layout.root} (committed: "
                                        f"{', '.join(map(str, steps))})")
    m = layout.read_manifest(step)
    base = layout.base(step, rank)
    if base is None:  # the engine's own file of one rank
        from flashckpt.engine.loader import StorageLoader

        loader = StorageLoader(layout, rank, weights_only=weights_only, resolve=lambda p: p)
        return _Read(step, "engine", loader.load_step(step))
    local = layout.storage.local_path(base)
    if local is None or not os.path.isdir(local):
        raise E.InvalidArgumentError(f"export: step {step} is a set of files in {base}, which export reads from a "
                                     "local directory only; copy the step's directory to this machine (or mount "
                                     "the store) and export from there")
    names = sorted(f.name for f in m.all_files() if f.name and f.kind != "tracker")
    return _read_dir(local, names, step, weights_only)


def _read_dir(d: str, names: list[str], step: int, weights_only: bool) -> _Read:
    """The state of the checkpoint directory ``d`` holding the files ``names``, by the framework that wrote it;
    a framework's reader failing is said in one line that names the directory (``CheckpointCorruptError``)."""
    try:
        return _read_framework(d, names, step, weights_only)
    except (E.FlashCheckpointError, OSError, MemoryError):
        raise
    except Exception as e:  # the framework's own reader refused the files (missing ranks' shards, damage)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise E.CheckpointCorruptError(f"export: step {step}'s files in {d} could not be read ({type(e).__name__}: "
                                       f"{first})") from e


def _read_framework(d: str, names: list[str], step: int, weights_only: bool) -> _Read:
    import torch

    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return _Read(step, "dcp", _load_dcp(d))
    if any(_DS_MODEL.match(n) for n in names):
        model_file = next(n for n in names if _DS_MODEL.match(n))
        if any(_DS_ZERO.match(n) for n in names):
            return _Read(step, "deepspeed", _load_zero(os.path.dirname(os.path.join(d, model_file))))
        states = torch.load(os.path.join(d, model_file), map_location="cpu", weights_only=weights_only)
        return _Read(step, "deepspeed", {"module": states["module"]})
    weights = [n for n in _HF_WEIGHTS if n in names] or [n for n in names if _is_shard(n)]
    if weights:
        configs = [os.path.join(d, n) for n in _HF_CONFIGS if n in names]
        return _Read(step, "hf", _load_hf(d, names, weights_only), configs)
    raise E.InvalidArgumentError(
        f"export: step {step} in {d} holds {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}: not a checkpoint "
        "export knows (an HF Trainer checkpoint-N, a DCP checkpoint with .metadata, a DeepSpeed tag with "
        "mp_rank_*_model_states.pt, or the engine's own file of a state dict)")


def _is_shard(name: str) -> bool:
    return bool(re.fullmatch(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)", name))


def _load_dcp(d: str) -> dict[str, Any]:
    """The full state of the DCP checkpoint in ``d``, consolidated in this process as PyTorch's own
    ``dcp_to_torch_save`` does (every rank's shards put together; no process group)."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        _load_state_dict(sd, storage_reader=FileSystemReader(d), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def _load_zero(tag_dir: str) -> dict[str, Any]:
    """The fp32 weights of DeepSpeed ZeRO tag ``tag_dir``, put together by DeepSpeed's ``zero_to_fp32``."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise E.InvalidArgumentError(f"export: {tag_dir} is a DeepSpeed ZeRO checkpoint and deepspeed is not "
                                     f"installed ({e}); install it (pip install deepspeed) to export it") from None
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints what it reads
        sd = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir))
    return {"module": dict(sd)}


def _load_hf(d: str, names: list[str], weights_only: bool) -> dict[str, Any]:
    """The weights of an HF checkpoint directory: safetensors files (single, sharded) or ``torch.save`` ones."""
    import json

    import torch
    from safetensors.torch import load_file

    def load(name: str) -> dict[str, Any]:
        path = os.path.join(d, name)
        if name.endswith(".safetensors"):
            return load_file(path)
        return dict(torch.load(path, map_location="cpu", weights_only=weights_only))

    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("adapter_model.safetensors", ""), ("pytorch_model.bin", "pytorch_model.bin.index.json"),
                          ("adapter_model.bin", "")):
        if single in names:
            return load(single)
        if index and index in names:
            with open(os.path.join(d, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            sd: dict[str, Any] = {}
            for shard in shards:
                sd.update(load(shard))
            return sd
    raise E.InvalidArgumentError(f"export: {d} holds weight shards without their index file")


def _read_memory(loc: str, step: int | None, rank: int, weights_only: bool, stack: contextlib.ExitStack) -> _Read:
    """The state of a snapshot in this node's shared memory: a state dict as is, a set of files laid out in
    a scratch directory (with the other ranks' files of the step this node holds: a DCP or ZeRO step needs
    them) and read as the committed step would be."""
    from flashckpt.format.files import FileSet, write_entry
    from flashckpt.memory.reader import SnapshotReader

    reader = stack.enter_context(SnapshotReader(loc, rank=rank, weights_only=weights_only))
    held = reader.snapshots()
    pick = next((s for s in held if step is None or s.step == step), None)
    if pick is None:
        what = "no snapshot" if step is None else f"no snapshot of step {step}"
        steps = ", ".join(str(s.step) for s in held) or "none"
        raise E.CheckpointNotFoundError(f"export: this node's shared memory holds {what} of rank {rank} for {loc} "
                                        f"(steps held: {steps}); export a committed step without --from-memory")
    state = reader.load(pick.step)
    if not isinstance(state, FileSet):
        return _Read(pick.step, "engine", state)
    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="flashckpt-export-"))
    sets = [state]
    for r in range(pick.world_size or 1):
        if r != rank:
            with SnapshotReader(loc, rank=r, weights_only=weights_only) as other:
                if pick.step in other.memory_steps():
                    sets.append(other.load(pick.step))
    names = set()
    for fs in sets:
        for name, entry in fs.items():
            if entry.kind == "tracker":
                continue
            names.add(name)
            write_entry(os.path.join(scratch, name), entry)
    return _read_dir(scratch, sorted(names), pick.step, weights_only)


# ----------------------------------------------------------------------------------------------- choosing
def _select(state: Any, key: str | None) -> tuple[str, Any]:
    """(the key chosen, its sub-tree) of ``state`` (see ``export_step``'s ``key``)."""
    if key is None:
        key = next((k for k in MODEL_KEYS if isinstance(state, dict) and isinstance(state.get(k), dict)), "")
    tree = state
    for part in key.split(".") if key else []:
        if not isinstance(tree, dict) or part not in tree:
            top = ", ".join(map(str, list(state)[:12])) if isinstance(state, dict) else type(state).__name__
            raise E.InvalidArgumentError(f"export: the checkpoint holds no {key!r} (at {part!r}); its top-level keys: "
                                         f"{top}; pass --key with one of them, or --key '' for the whole state")
        tree = tree[part]
    return key, tree


def _strip(tree: Any, prefix: str) -> Any:
    """``tree`` with ``prefix`` taken off its top-level keys that start with it."""
    if not isinstance(tree, dict):
        return tree
    out = {(k[len(prefix):] if isinstance(k, str) and k.startswith(prefix) else k): v for k, v in tree.items()}
    if len(out) != len(tree):
        raise E.InvalidArgumentError(f"export: taking {prefix!r} off the keys makes two keys the same; choose "
                                     "another --strip-prefix")
    return out


def _flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) of every leaf of nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


# ----------------------------------------------------------------------------------------------- writing
def _write(read: _Read, tree: Any, key: str, out: str, fmt: str, max_shard_size: str | int,
           progress: bool | None, source: str) -> Exported:
    """Writes ``tree`` to ``out`` (beside it first, then renamed into place); the files written."""
    import torch

    leaves = list(_flat(tree))
    tensors = {k: v for k, v in leaves if isinstance(v, torch.Tensor)}
    if not tensors:
        raise E.InvalidArgumentError(f"export: step {read.step}'s {key or 'state'} holds no tensors; pass --key "
                                     "with the sub-tree of the weights")
    dropped = [k for k, v in leaves if not isinstance(v, torch.Tensor)] if fmt == "safetensors" else []
    bar = progress_bar(f"export step {read.step}", len(tensors), unit="tensor", show=progress)
    tmp = f"{out}.partial-{os.getpid()}"
    try:
        with bar:
            for name, t in tensors.items():
                tensors[name] = _whole(t)
                bar.update(1)
            bar.set_postfix_str("writing")
            if fmt == "torch":
                torch.save(tree, tmp)
            else:
                _save_safetensors(tensors, tmp, max_shard_size, read.configs)
        os.rename(tmp, out)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _unlink(tmp)
        raise
    paths = [out] if fmt == "torch" else sorted(os.path.join(out, n) for n in os.listdir(out))
    return Exported(read.step, read.kind, source, key, paths, len(tensors), dropped)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, detached, and owning its storage: a view into a larger buffer (DeepSpeed's
    ``zero_to_fp32`` returns its weights as views of one flat buffer) is copied, since safetensors writes
    whole storages and refuses a part of one; tensors sharing one storage whole (tied weights) stay shared."""
    t = t.detach().cpu()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _save_safetensors(tensors: dict[str, torch.Tensor], d: str, max_shard_size: str | int, configs: list[str]) -> None:
    from huggingface_hub import save_torch_state_dict

    os.mkdir(d)
    try:
        save_torch_state_dict(tensors, d, max_shard_size=max_shard_size)
    except (RuntimeError, ValueError) as e:  # what safetensors refuses (shared storages it cannot split...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise E.InvalidStateDictError(f"export: safetensors cannot hold these tensors ({first}); --format torch "
                                      "writes any state") from e
    for c in configs:
        shutil.copyfile(c, os.path.join(d, os.path.basename(c)))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# ----------------------------------------------------------------------------------------------- command
def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``export`` to the ``flashckpt`` subcommands ``sub`` (``argparse``'s ``add_subparsers()``)."""
    p = sub.add_parser("export", help="export a committed step (or a snapshot in memory) as Hugging Face "
                                      "safetensors or one torch.save file")
    p.add_argument("dir", help="the checkpoint dir (an HF Trainer's output dir, the engine's or an adapter's dir)")
    p.add_argument("out", help="safetensors: the directory to create; torch: the file to create (must not exist)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the newest)")
    p.add_argument("--format", choices=FORMATS, default="safetensors",
                   help="safetensors (sharded, with model.safetensors.index.json) or torch (one torch.save file)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="safetensors: the largest shard, such as 5GB, 200MB or a byte count (default: 5GB)")
    p.add_argument("--from-memory", action="store_true",
                   help="export a snapshot in this node's shared memory instead of a committed step")
    p.add_argument("--key", default=None,
                   help=f"the dotted sub-tree of the state to export (default: the first of {', '.join(MODEL_KEYS)} "
                        "present, else the whole state; '' for the whole state)")
    p.add_argument("--strip-prefix", default=None, help="take this prefix off the exported keys (module., _orig_mod.)")
    p.add_argument("--rank", type=int, default=0,
                   help="the rank whose state an engine or HF step exports (DCP and DeepSpeed steps hold every "
                        "rank's; default: 0)")
    p.add_argument("--trust", action="store_true",
                   help="read files with torch.load(weights_only=False): only for a trusted checkpoint that holds "
                        "Python objects")
    p.set_defaults(fn=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    """``flashckpt export``: prints what was written; an error is said in one line by ``cli.main`` (exit 2)."""
    done = export_step(args.dir, args.out, step=args.step, format=args.format, max_shard_size=args.max_shard_size,
                       from_memory=args.from_memory, key=args.key, strip_prefix=args.strip_prefix, rank=args.rank,
                       weights_only=not args.trust)
    what = f"'{done.key}'" if done.key else "the whole state"
    print(f"step {done.step} ({done.kind}, from {done.source}): {done.tensors} tensors of {what} -> {args.out} "
          f"({len(done.paths)} file{'s' if len(done.paths) != 1 else ''})")
    if done.dropped:
        shown = ", ".join(done.dropped[:5]) + (" ..." if len(done.dropped) > 5 else "")
        print(f"left out {len(done.dropped)} non-tensor value{'s' if len(done.dropped) != 1 else ''} "
              f"(safetensors holds tensors only): {shown}", file=sys.stderr)
    return 0
