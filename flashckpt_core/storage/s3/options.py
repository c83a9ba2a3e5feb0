"""How the S3 backend talks to its store: ``S3Options``, from ``storage_options`` or ``FLASHCKPT_S3_*``
environment variables (``config.S3Knobs``). A frozen dataclass; imports only the leaf layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flashckpt import errors as E
from flashckpt.config import knob

__all__ = ["S3Options"]


@dataclass(frozen=True)
class S3Options:
    """How the S3 backend talks to the store (defaults are fast on AWS and on local servers).

    Attributes:
        endpoint_url: the store's endpoint (default: the AWS configuration's, e.g. ``AWS_ENDPOINT_URL``).
        region: the region (default: the AWS configuration's, else us-east-1).
        profile: an AWS profile name.
        addressing_style: ``"auto"``, ``"path"`` or ``"virtual"`` (S3-compatible stores often need path).
        part_size_mb: multipart part size; files up to it go in one PutObject.
        concurrency: parts of one file uploaded (or ranges downloaded) at once, at most.
        max_attempts: attempts per request before the file fails (within ``deadline_s``).
        deadline_s: a file's upload (or download) gives up after this long, retries included.
        read_timeout_s: the longest any request waits without progress before it is abandoned and retried;
            the bounds per kind of request below are capped at it.
        meta_timeout_s: a metadata request (HEAD, a commit record's GET or PUT, LIST, DELETE, creating or
            aborting a multipart upload) that makes no progress for this long (connecting, sending,
            waiting for the answer or reading it) is abandoned and retried.
        min_mbps: a data request (an upload part, a file's PutObject, a ranged GET, completing an upload,
            a copy) is abandoned and retried after ``meta_timeout_s + part_size_mb / min_mbps`` seconds
            without progress (``data_timeout_s``): a part that stalls is retried within seconds, a slow
            link is not mistaken for a stall.
        checksums: send each part's CRC-32 as its S3 checksum (``x-amz-checksum-crc32``).
        conditional_writes: commit records are created with ``If-None-Match: *`` (a concurrent writer of
            the same record is an error, not an overwrite).
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str = "auto"
    part_size_mb: int = 64
    concurrency: int = 8
    max_attempts: int = 10
    deadline_s: float = 1800.0
    read_timeout_s: float = 120.0
    meta_timeout_s: float = 5.0
    min_mbps: float = 8.0
    checksums: bool = True
    conditional_writes: bool = True

    @classmethod
    def from_env(cls, **given: Any) -> S3Options:
        """``given`` fields, else ``FLASHCKPT_S3_<FIELD>`` from the environment (``config.S3Knobs``), else
        the defaults.

        Raises:
            InvalidArgumentError: an unknown field, or a value of the wrong type (given or in the environment).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(given) - set(fields)
        if unknown:
            raise E.InvalidArgumentError(f"storage_options {sorted(unknown)}: unknown for s3:// (known: "
                                         f"{', '.join(sorted(fields))})")
        kw: dict[str, Any] = {}
        env = knob("s3").given()
        for name, f in fields.items():
            raw = given.get(name, env.get(name))
            if raw is None:
                continue
            kind: type[Any] = type(f.default) if f.default is not None else str
            try:
                if kind is bool and isinstance(raw, str):
                    kw[name] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    kw[name] = kind(raw)
            except (TypeError, ValueError):
                raise E.InvalidArgumentError(f"storage option {name}={raw!r}: a {kind.__name__} is needed") from None
        opts = cls(**kw)
        if (opts.part_size_mb < 5 or opts.concurrency < 1 or opts.max_attempts < 1 or opts.read_timeout_s <= 0
                or opts.meta_timeout_s <= 0 or opts.min_mbps <= 0):
            raise E.InvalidArgumentError(f"{opts}: part_size_mb >= 5 (S3's minimum), concurrency and max_attempts >= 1, "
                                         "read_timeout_s, meta_timeout_s and min_mbps > 0")
        if opts.addressing_style not in ("auto", "path", "virtual"):
            raise E.InvalidArgumentError(f"addressing_style={opts.addressing_style!r}: auto, path or virtual")
        return opts

    def timeout_s(self, kind: str) -> float:
        """How long a request of ``kind`` (``"meta"`` or ``"data"``) may go without progress: the
        connection, each send of its body and each read of its answer (see the attributes)."""
        if kind == "meta":
            return min(self.read_timeout_s, self.meta_timeout_s)
        return min(self.read_timeout_s, self.meta_timeout_s + self.part_size_mb / self.min_mbps)

    @property
    def first_contact_s(self) -> float:
        """How long a first contact with the store (the checkpoint dir's probe at the start) may take, retries
        included: three metadata bounds."""
        return 3 * self.timeout_s("meta")
