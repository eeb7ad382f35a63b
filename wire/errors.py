"""The errors a weight load ends with, on every path (disk, object store, tensor
handles, broadcast): the receiver raises them, the engines map them to their
answers (HTTP 400/403, a failed update that leaves the old version serving).
Imports nothing, so the HTTP layer can catch them without torch.
"""

from __future__ import annotations


class WeightLoadError(ValueError):
    """The directory cannot be loaded into this model; the model is untouched."""


class WeightIntegrityError(WeightLoadError):
    """A file differs from the directory's manifest.json (size or sha256)."""


class WeightPathError(WeightLoadError, PermissionError):
    """A file the reload would open lies outside the allowed roots (HTTP: 403; a
    PermissionError too, so the HTTP layer catches it without importing torch)."""
