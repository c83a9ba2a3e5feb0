"""Every environment variable flashckpt reads is a field of ``config.Knobs``: named, parsed, defaulted and
documented in ``config.py`` alone; every other module takes the value from a ``Knobs`` (or ``config.knob``)."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest
from flashckpt import config
from flashckpt.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("flashckpt_core", "integrations", "patches")
NAME = re.compile(r"FLASHCKPT_[A-Z0-9_]+")
TABLE = config.knob_variables()
VARIABLES = {env for env, _ in TABLE}


def _library_files() -> list[Path]:
    files = [p for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50, f"the library's sources are not under {ROOT}"
    return files


def test_table_has_no_duplicates():
    names = [env for env, _ in TABLE]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(NAME.fullmatch(n) for n in names)


def test_every_variable_named_in_the_library_is_a_knob():
    """Every ``FLASHCKPT_*`` name in the library's source (code, messages, docstrings) is a Knobs field's
    variable; a name ending in ``_`` (``FLASHCKPT_S3_*``) is the prefix of some."""
    unknown = {}
    for path in _library_files():
        for name in set(NAME.findall(path.read_text())):
            known = any(v.startswith(name) for v in VARIABLES) if name.endswith("_") else name in VARIABLES
            if not known:
                unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"FLASHCKPT_* variables named outside config.Knobs: {unknown}"


def _environ_access(node: ast.AST) -> ast.AST | None:
    """The key of ``os.environ[key]``, ``os.environ.get/pop/setdefault(key)`` or ``os.getenv(key)``."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
        return node.slice
    if isinstance(node, ast.Call) and node.args:
        func = ast.unparse(node.func)
        if func in ("os.getenv", "getenv") or (
                isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in ("os.environ", "environ")):
            return node.args[0]
    return None


def test_only_config_reads_or_sets_a_variable_by_name():
    """Outside ``config.py`` no module reads or sets a ``FLASHCKPT_*`` variable by a literal name (the
    names a launcher sets for its children come from ``config``'s constants)."""
    found = []
    for path in _library_files():
        if path == ROOT / "flashckpt_core" / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key = _environ_access(node)
            if key is not None and "FLASHCKPT_" in ast.unparse(key):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "read these through config.Knobs / config.knob:\n" + "\n".join(found)


def test_every_knob_is_documented_where_it_is_declared():
    groups = {"": config.Knobs, "replica.": config.ReplicaKnobs, "s3.": config.S3Knobs}
    for env, dotted in TABLE:
        prefix, _, name = dotted.rpartition(".")
        doc = groups[prefix + "." if prefix else ""].__doc__ or ""
        assert re.search(rf"^\s+{name}: .*?{env}\b", doc, re.M | re.S), f"{dotted} ({env}) is not documented"


def test_s3_knobs_are_the_s3_options():
    pytest.importorskip("xxhash")
    from flashckpt.storage.s3.options import S3Options

    assert [f.name for f in dataclasses.fields(config.S3Knobs)] == [f.name for f in dataclasses.fields(S3Options)]
    for f in dataclasses.fields(S3Options):
        assert f"FLASHCKPT_S3_{f.name.upper()}" in VARIABLES


def test_defaults_and_empty_values(monkeypatch):
    for env in VARIABLES:
        monkeypatch.delenv(env, raising=False)
    unset = config.Knobs.from_env()
    assert (unset.grace_s, unset.slots, unset.spare_slots, unset.last_words, unset.warm_delay_s, unset.cuda_load,
            unset.replica.mode, unset.s3.part_size_mb) == (600.0, 2, 4, True, 5.0, "staged", "auto", None)
    for env in VARIABLES:
        monkeypatch.setenv(env, "")
    assert config.Knobs.from_env() == unset  # an empty variable is an unset one


@pytest.mark.parametrize("env", sorted(VARIABLES))
def test_a_bad_value_names_its_variable(monkeypatch, env):
    """A value a knob cannot take raises InvalidArgumentError naming the variable, from ``Knobs.from_env()``
    and from ``knob()``; a knob that takes any text takes this one too."""
    dotted = dict(TABLE)[env]
    monkeypatch.setenv(env, "not-a-value")
    try:
        knobs = config.Knobs.from_env()
    except InvalidArgumentError as e:
        assert env in str(e)
        with pytest.raises(InvalidArgumentError, match=env):
            config.knob(dotted.split(".")[0])
        return
    value = knobs
    for part in dotted.split("."):
        value = getattr(value, part)
    assert isinstance(value, str)  # text (or a word with a fallback)


def test_knob_reads_now(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_CUDA_LOAD", "register")
    assert config.knob("cuda_load") == "register"
    monkeypatch.setenv("FLASHCKPT_CUDA_LOAD", "PAGEABLE ")
    assert config.knob("cuda_load") == "pageable"
    monkeypatch.setenv("FLASHCKPT_REPLICA_GROUP_SIZE", "0")
    with pytest.raises(InvalidArgumentError, match="FLASHCKPT_REPLICA_GROUP_SIZE"):
        config.knob("replica")
    assert os.environ["FLASHCKPT_REPLICA_GROUP_SIZE"] == "0"  # read, never changed
