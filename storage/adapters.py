"""Adapter versions (``train.lora``): which full version an adapter applies to.

Owns the identity an adapter version carries (``AdapterOf``: the base version and the
digest of its files) and the check that a base is that very version. An adapter's
files are peft's own (``layout.ADAPTER_WEIGHTS``, ``layout.ADAPTER_CONFIG``),
hashed and committed like any version's; reading their tensors is the engines' and
the exporter's. Never reads tensors and never writes.
"""

from __future__ import annotations

from storage.errors import IntegrityError
from storage.layout import version_name
from storage.types import AdapterOf, WeightsManifest


def adapter_of(base: WeightsManifest) -> AdapterOf:
    """The identity an adapter trained on ``base`` records; ``base`` must be full."""
    if base.adapter is not None or base.delta is not None:
        kind = "an adapter" if base.adapter is not None else "a delta"
        raise IntegrityError(
            f"{version_name(base.version)} is {kind}; an adapter applies to a full version "
            "only (the base model, v0)"
        )
    return AdapterOf(base=base.version, base_digest=base.digest())


def check_base(m: WeightsManifest, base: WeightsManifest | None) -> WeightsManifest:
    """``base``, once it is the very version adapter ``m`` was trained on; else an
    IntegrityError naming both digests."""
    assert m.adapter is not None
    b = version_name(m.adapter.base)
    who = f"adapter {version_name(m.version)}"
    if base is None:
        raise IntegrityError(
            f"{who}: its base {b} is missing (deleted or never committed); restore {b}"
        )
    refuse_other_base(m, base.digest(), b)
    return base


def refuse_other_base(m: WeightsManifest, digest: str | None, where: str) -> None:
    """IntegrityError unless ``digest`` (of the full weights at ``where``) is the digest
    of the base adapter ``m`` was trained on. None: weights without a manifest, whose
    identity is unknown, which an adapter is never applied to."""
    assert m.adapter is not None
    want = m.adapter.base_digest
    if digest == want:
        return
    got = "unknown (no manifest.json)" if digest is None else f"{digest[:12]}..."
    raise IntegrityError(
        f"adapter {version_name(m.version)} was trained on {version_name(m.adapter.base)} "
        f"(files digest {want[:12]}...), but {where} has digest {got}: an adapter is "
        f"applied only to its own base; load {version_name(m.adapter.base)} of this run first"
    )
