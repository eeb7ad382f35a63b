"""Rebuilding a delta version (``storage.delta``) into its full files, verified.

Owns the reader's side of deltas: which full file comes from where (stored
whole, XOR-decoded against the base, or the base's file as is), the checks that
the base is the one the delta was made from, and the final check of every
rebuilt file against the full size and sha256 recorded at publish. A wrong or
missing base, or a damaged delta, is an IntegrityError naming the version, the
base and the file; nothing half-rebuilt is ever left where a loader looks (the
caller rebuilds in a staging folder). Must not fetch anything: the stored files
and the base are already local and verified when it runs.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np

from storage.delta_format import (
    DELTA_SUFFIX,
    FRAME,
    MAX_HEADER,
    TENSORS,
    BaseImage,
    parse_layout,
    read_frames,
    read_layout,
    xor_into,
)
from storage.errors import IntegrityError
from storage.hashio import LocalHashingWriter, hash_file
from storage.layout import version_name
from storage.types import FileEntry, WeightsManifest

# Files rebuilt at once: decompression, XOR and sha256 all release the GIL.
_THREADS = 4
# Frames a file's reader decompresses ahead of the frame being XORed, written and
# hashed: each file's rebuild then takes the longer of the two, not their sum.
_AHEAD = 1


def _who(m: WeightsManifest) -> str:
    assert m.delta is not None
    return f"{version_name(m.version)} (a delta of {version_name(m.delta.base)})"


def check_base(m: WeightsManifest, base: WeightsManifest | None) -> WeightsManifest:
    """The base manifest, once it is the very version ``m`` was made against."""
    assert m.delta is not None
    b = version_name(m.delta.base)
    if base is None:
        raise IntegrityError(
            f"{_who(m)}: its base {b} is missing (deleted or never committed); "
            f"republish {version_name(m.version)} full, or restore {b}"
        )
    if base.delta is not None:
        raise IntegrityError(
            f"{_who(m)}: {b} is itself a delta; a delta's base must be full. Republish "
            f"{version_name(m.version)}"
        )
    if base.digest() != m.delta.base_digest:
        raise IntegrityError(
            f"{_who(m)}: {b} is not the version it was made from (its files' digest "
            f"{base.digest()[:12]}... != {m.delta.base_digest[:12]}...: the base was republished "
            f"with other bytes); republish {version_name(m.version)}"
        )
    return base


def plan(m: WeightsManifest, base: WeightsManifest) -> dict[str, str]:
    """full file name -> "stored" | "xor" | "base", after checking that every stored
    file has a use and every "base" file is the base's identical file."""
    assert m.delta is not None
    stored_files = {f.name: f for f in m.files}
    stored = set(stored_files)
    base_files = {f.name: f for f in base.files}
    out: dict[str, str] = {}
    for e in m.delta.full:
        if e.name in stored:
            if stored_files[e.name] != e:  # pulls verify stored files: equal entries suffice
                raise IntegrityError(
                    f"{_who(m)}: {e.name!r} is stored whole but its stored and full entries "
                    f"differ; the manifest is damaged: republish {version_name(m.version)}"
                )
            out[e.name] = "stored"
        elif e.name + DELTA_SUFFIX in stored:
            if e.name not in base_files:
                raise IntegrityError(
                    f"{_who(m)}: {e.name!r} is stored as an XOR against the base, which has no "
                    f"such file; the base is wrong: republish {version_name(m.version)}"
                )
            out[e.name] = "xor"
        else:
            b = base_files.get(e.name)
            if b is None or (b.bytes, b.sha256) != (e.bytes, e.sha256):
                raise IntegrityError(
                    f"{_who(m)}: {e.name!r} should be the base's file as is, but the base "
                    f"{'has no such file' if b is None else 'holds other bytes'}; "
                    f"republish {version_name(m.version)}"
                )
            out[e.name] = "base"
    extra = stored - set(out) - {n + DELTA_SUFFIX for n, how in out.items() if how == "xor"}
    if extra:
        raise IntegrityError(
            f"{_who(m)}: stored files {sorted(extra)[:5]} rebuild nothing; the manifest is "
            f"damaged: republish {version_name(m.version)}"
        )
    return out


def rebuild_dir(stage: str, m: WeightsManifest, base_dir: str, base: WeightsManifest) -> None:
    """Turn ``stage`` (holding ``m.files``, verified) into the full files of
    ``m.delta.full``, each verified; the delta files are removed from it."""
    assert m.delta is not None
    how = plan(m, check_base(m, base))
    full = {e.name: e for e in m.delta.full}
    jobs = [n for n, h in how.items() if h != "stored"]
    with ThreadPoolExecutor(max(1, min(_THREADS, len(jobs)))) as pool:
        futs = [
            pool.submit(_decode if how[n] == "xor" else _take_base, stage, base_dir, full[n], m)
            for n in sorted(jobs, key=lambda n: -full[n].bytes)
        ]
        for f in futs:
            f.result()
    for n, h in how.items():
        if h == "xor":
            os.unlink(os.path.join(stage, n + DELTA_SUFFIX))


def _decode(stage: str, base_dir: str, e: FileEntry, m: WeightsManifest) -> None:
    src = os.path.join(stage, e.name + DELTA_SUFFIX)
    dst = os.path.join(stage, e.name)
    base_path = os.path.join(base_dir, e.name)
    out = LocalHashingWriter(e.name, dst, writeback=False)  # a cache: no fsync
    image: BaseImage | None = None
    buf = np.empty(FRAME, np.uint8)  # reused: fresh pages cost more than the XOR
    try:
        with open(src, "rb") as f:
            mode, frames = read_frames(
                f, f"{_who(m)} {e.name + DELTA_SUFFIX!r}", FRAME + MAX_HEADER, _AHEAD + 2
            )
            off = 0
            # closing: the reader thread stops before the file it reads is closed
            with closing(_ahead(frames, _AHEAD)) as ahead:
                for x in ahead:
                    if off + len(x) > e.bytes:
                        raise IntegrityError(
                            f"{_who(m)}: {e.name + DELTA_SUFFIX!r} decodes to more than the "
                            f"{e.bytes} bytes of {e.name!r}; the delta is damaged: republish it"
                        )
                    if image is None:
                        image = _image(mode, x, base_path, e, m)
                    if len(x) > len(buf):
                        buf = np.empty(len(x), np.uint8)
                    out.write(xor_into(image.read_into(off, buf[: len(x)]), x))
                    off += len(x)
        if image is None:  # an empty file
            image = BaseImage.raw(base_path)
    except BaseException:
        out.abort()
        raise
    finally:
        if image is not None:
            image.close()
    out.close()
    if (out.bytes, out.sha256) != (e.bytes, e.sha256):
        raise IntegrityError(
            f"{_who(m)}: rebuilt {e.name!r} has {out.bytes} bytes sha256 {str(out.sha256)[:12]}..., "
            f"the manifest says {e.bytes} bytes sha256 {e.sha256[:12]}...: the delta or its base "
            f"{version_name(m.delta.base)} is damaged; re-pull the base, or republish "  # type: ignore[union-attr]
            f"{version_name(m.version)}"
        )


def _image(
    mode: bytes, first: bytes, base_path: str, e: FileEntry, m: WeightsManifest
) -> BaseImage:
    if mode != TENSORS:
        return BaseImage.raw(base_path)
    # The image is zero over the header, so the first frame holds the header as is.
    new = parse_layout(first)
    base = read_layout(base_path)
    if new is None or base is None:
        raise IntegrityError(
            f"{_who(m)}: {e.name + DELTA_SUFFIX!r} says tensor-aligned, but "
            f"{'its header' if new is None else 'the base file'} is not safetensors; "
            f"the delta or the base is damaged: republish {version_name(m.version)}"
        )
    return BaseImage.tensors(base_path, base, new)


def _take_base(stage: str, base_dir: str, e: FileEntry, m: WeightsManifest) -> None:
    src, dst = os.path.join(base_dir, e.name), os.path.join(stage, e.name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)  # the cache's files are never written in place (storage.pull)
    except OSError:
        shutil.copyfile(src, dst)
    _check(dst, e, m, "taken from the base")


def _check(path: str, e: FileEntry, m: WeightsManifest, how: str) -> None:
    n, sha = hash_file(path)
    if (n, sha) != (e.bytes, e.sha256):
        raise IntegrityError(
            f"{_who(m)}: {e.name!r} ({how}) has {n} bytes sha256 {sha[:12]}..., the manifest "
            f"says {e.bytes} bytes sha256 {e.sha256[:12]}...; re-pull, or republish "
            f"{version_name(m.version)}"
        )


def _ahead(items: Iterator[np.ndarray], depth: int) -> Iterator[np.ndarray]:
    """``items``, produced by a thread up to ``depth`` items ahead of the consumer
    (``read_frames`` with ``depth + 2`` buffers keeps every item it yields intact
    while the consumer holds it). An exception in the producer is raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in items:
                if not put(("item", x)):
                    return
            put(("end", None))
        except BaseException as e:  # handed to the consumer, which raises it
            put(("error", e))

    t = threading.Thread(target=run, name="storage-rebuild-read", daemon=True)
    t.start()
    try:
        while True:
            kind, x = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise x
            yield x
    finally:
        stop.set()
        t.join()
