"""Wire objects of ``storage``: what is written as JSON next to the data.

Owns the schemas (weights manifest, checkpoint COMMIT, lease, GC report) and
their validation; must not do I/O.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from storage.layout import COMMIT, MANIFEST, check_file_name

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class FileTree(BaseModel):
    """A file's hash tree (``storage.tree``): the hash of each fixed-size chunk and a
    root over them, so readers hash chunks on every core and name a damaged one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algo: Literal["blake3"] = "blake3"  # the hash of each chunk and of the root
    chunk: int = Field(gt=0)  # bytes per chunk, the last one shorter (storage.tree.CHUNK)
    hashes: tuple[str, ...]  # lowercase hex hash of each chunk, in file order
    root: str  # hex hash over the size, chunk size, sha256 and chunk hashes (tree.root_of)

    @field_validator("hashes")
    @classmethod
    def _hexes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, h in enumerate(v):
            if not _SHA256_RE.match(h):
                raise ValueError(f"chunk hash {i} {h!r} is not 64 lowercase hex digits")
        return v

    @field_validator("root")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _SHA256_RE.match(v):
            raise ValueError(f"tree root {v!r} is not 64 lowercase hex digits")
        return v


class FileEntry(BaseModel):
    """One committed file: what a reader checks before trusting it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # relative to its folder; no absolute names, no '..'
    bytes: int = Field(ge=0)  # exact size in bytes
    sha256: str  # lowercase hex digest of the whole file (kept for tools that read it)
    # Weight files: chunk hashes readers verify instead of the sha256. None: an entry
    # written before trees (or a checkpoint's), checked by its sha256.
    tree: FileTree | None = None

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _SHA256_RE.match(v):
            raise ValueError(f"sha256 {v!r} is not 64 lowercase hex digits")
        return v

    @model_validator(mode="after")
    def _chunks(self) -> FileEntry:
        t = self.tree
        if t is not None and len(t.hashes) != -(-self.bytes // t.chunk):
            raise ValueError(
                f"the tree of {self.name!r} lists {len(t.hashes)} chunk hashes, but "
                f"{self.bytes} bytes in chunks of {t.chunk} make {-(-self.bytes // t.chunk)}"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_no_tree(self, handler):  # noqa: ANN001, ANN202
        # An entry without a tree is written exactly as before trees existed.
        out = handler(self)
        if self.tree is None:
            out.pop("tree", None)
        return out


def _check_entries(files: tuple[FileEntry, ...], reserved: tuple[str, ...]) -> None:
    seen: set[str] = set()
    for f in files:
        check_file_name(f.name, reserved)
        if f.name in seen:
            raise ValueError(f"file {f.name!r} is listed twice; each name must appear once")
        seen.add(f.name)


class DeltaOf(BaseModel):
    """What makes a version a delta (``storage.delta``): the full version its stored
    files are XORed against, and the full files a reader must rebuild."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: int = Field(ge=0)  # a full version (never itself a delta) of the same run
    base_digest: str  # WeightsManifest.digest() of the base: a republished base is refused
    # How the stored files encode new XOR base image (storage.delta_format): "xor-words"
    # (written now: per frame, a bitmap of the nonzero 8-byte words and those words, in
    # zstd) or "xor-zstd" (read only: per frame, zstd of all of the XOR).
    codec: Literal["xor-zstd", "xor-words"] = "xor-words"
    full: tuple[
        FileEntry, ...
    ]  # the rebuilt version's files: name, bytes, sha256 of the FULL bytes

    @model_validator(mode="after")
    def _names(self) -> DeltaOf:
        _check_entries(self.full, (MANIFEST,))
        return self


class AdapterOf(BaseModel):
    """What makes a version a LoRA adapter (``train.lora``): its files are peft's
    (``adapter_model.safetensors``, ``adapter_config.json``), to be applied to the full
    version ``base``, and only to the very bytes it was trained on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: int = Field(ge=0)  # the full version the adapter applies to (v0, the base model)
    base_digest: str  # WeightsManifest.digest() of the base: another base is refused
    format: Literal["peft-lora"] = "peft-lora"  # peft's adapter files, key names as it saves them


class WeightsManifest(BaseModel):
    """``weights/v000012/manifest.json``. Written last: its presence is the commit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=0)  # = the iteration that produced it; v0 is the base model
    run: str  # run name the version belongs to
    iteration: int = Field(ge=0)  # training iteration whose weights these are
    parent: int | None = Field(default=None, ge=0)  # version these were trained from
    created_at: float  # unix seconds when the manifest was written
    # The files' encoding: safetensors (an HF model folder; with ``adapter``, peft's
    # adapter files, whose own format ``adapter.format`` names).
    format: Literal["hf-safetensors"] = "hf-safetensors"
    files: tuple[FileEntry, ...]  # every file of the version except manifest.json
    # Set: the version is a delta; ``files`` are what is stored, ``delta.full`` what it rebuilds to.
    delta: DeltaOf | None = None
    # Set: the version is a LoRA adapter of a full version (its files are peft's).
    adapter: AdapterOf | None = None

    @model_validator(mode="after")
    def _names(self) -> WeightsManifest:
        _check_entries(self.files, (MANIFEST,))
        if self.delta is not None and self.delta.base >= self.version:
            raise ValueError(
                f"delta base v{self.delta.base} is not older than version {self.version}"
            )
        if self.adapter is not None and self.delta is not None:
            raise ValueError("a version is an adapter or a delta, never both")
        if self.adapter is not None and self.adapter.base >= self.version:
            raise ValueError(
                f"adapter base v{self.adapter.base} is not older than version {self.version}"
            )
        return self

    def dump(self) -> dict:
        """The JSON form written to manifest.json; a full version's has neither a
        ``delta`` nor an ``adapter`` key (so its bytes are what they were before either
        existed)."""
        unset = {k for k in ("delta", "adapter") if getattr(self, k) is None}
        return self.model_dump(mode="json", exclude=unset or None)

    def rebuilt(self) -> WeightsManifest:
        """The manifest of the full folder a reader builds: ``delta.full`` as its files."""
        if self.delta is None:
            return self
        return self.model_copy(update={"files": self.delta.full, "delta": None})

    def file_set(self) -> set[tuple[str, int, str]]:
        """(name, bytes, sha256) of every file; equal sets = identical content."""
        return {(f.name, f.bytes, f.sha256) for f in self.files}

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def digest(self) -> str:
        """sha256 over the sorted (name, bytes, sha256) of ``files``: one string that
        changes whenever any stored byte does."""
        lines = sorted(f"{f.name}\t{f.bytes}\t{f.sha256}\n" for f in self.files)
        return hashlib.sha256("".join(lines).encode()).hexdigest()


class CheckpointCommit(BaseModel):
    """``checkpoints/iter_000012/COMMIT``. Written last: its presence is the commit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    iteration: int = Field(ge=0)  # k of the trainer state
    created_at: float  # unix seconds when COMMIT was written
    files: tuple[FileEntry, ...]  # every file of the checkpoint except COMMIT
    meta: dict  # caller's meta, e.g. {"weights_version": 12, "data_cursor": ...}

    @model_validator(mode="after")
    def _names(self) -> CheckpointCommit:
        _check_entries(self.files, (COMMIT,))
        return self


class Lease(BaseModel):
    """``lease.json``: the one writer of a run and its fence (see ``storage.lease``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner: str  # who writes: "host:pid" from tasks (a dead local pid is taken over at once)
    token: str  # random per acquisition; tells two acquisitions by one owner apart
    acquired_at: float  # unix seconds of this acquisition, by the holder's clock
    expires_at: float  # holder's clock + ttl; informational: takers never trust clocks
    fence: int = Field(0, ge=0)  # acquisition number; commits check it (0: written before fencing)
    ttl_s: float = Field(60.0, gt=0)  # how long a taker must see no renewal before taking over
    renewals: int = Field(0, ge=0)  # bumped by every renewal; a change = the holder is alive
    released: bool = False  # released by its holder: free to take at once, fence kept

    def live(self, now: float) -> bool:
        """By ``now``'s clock; only for display. Takeover uses renewals, not clocks."""
        return not self.released and now < self.expires_at


class GcReport(BaseModel):
    """What one ``RunStore.gc`` call kept and removed."""

    model_config = ConfigDict(frozen=True)

    deleted_versions: list[int]  # weight versions removed (manifest first, then files)
    deleted_checkpoints: list[int]  # checkpoint iterations removed (COMMIT first)
    kept_versions: list[int]  # committed versions left in place
    kept_checkpoints: list[int]  # committed checkpoints left in place
    protected: dict[int, str]  # version -> why it was kept beyond keep_last
    removed_debris: list[str]  # torn/staging folders cleaned up (no commit marker)


class Pulled(BaseModel):
    """What one ``RunStore.pull`` did on the machine it ran on."""

    model_config = ConfigDict(frozen=True)

    path: str  # cache_dir/v000012, verified
    copied: bool  # False: a complete copy was already there (another engine of this node pulled it)
    bytes: int  # bytes the version's files hold (a delta: once rebuilt)
    seconds: float  # wall time of the call, waiting for a concurrent pull of it included
    base: int | None = None  # a delta version: the full version it was rebuilt from
