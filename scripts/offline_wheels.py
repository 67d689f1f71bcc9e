"""The wheels an offline GPU machine needs, derived: what pyproject.toml declares, and what that needs in turn,
less what the GPU image already holds (scripts/gpu_image_packages.txt), each pinned to this venv's version.

    python scripts/offline_wheels.py           # NAME==VERSION, one a line: what `scripts/offline_gpu.sh pack` downloads

It replaces a hand-kept list that fell behind the code (on 2026-12-04 the pack lacked hiredis, which the
gateway's store imports, and the gateway could not start there). The walk follows each installed
distribution's own requirements (extras such as ``uvicorn[standard]`` included; markers evaluated for the
image's Python 3.12 on Linux) and stops at a package the image holds. Such a package is left out unless a
requirement asks for a version the image's does not satisfy, or for a minimum where the image's version is
not known: then this venv's version is carried too (the pack goes first on PYTHONPATH there).
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
IMAGE = REPO / "scripts" / "gpu_image_packages.txt"
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """``[project].dependencies`` of pyproject.toml."""
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def image_packages(path: Path = IMAGE) -> dict[str, str | None]:
    """canonical name -> the image's version (None where not known)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version or None
    return out


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET, "extra": extra}) for extra in (extras or {""}))


def _image_satisfies(req: Requirement, version: str | None) -> bool:
    if not req.specifier:
        return True
    return version is not None and req.specifier.contains(version, prereleases=True)


def closure(requirements: list[Requirement], image: dict[str, str | None]) -> dict[str, str]:
    """canonical name -> this venv's version of every distribution to carry."""
    carry: dict[str, str] = {}
    todo = [(req, set()) for req in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, parent_extras = todo.pop()
        if not _applies(req, parent_extras):
            continue
        name = canonical(req.name)
        if name in image and _image_satisfies(req, image[name]):
            continue  # the image's own, with whatever it needs
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError as exc:
            raise SystemExit(f"offline_wheels: {req} is required but not installed here; install the project "
                             "(make) first") from exc
        carry[name] = dist.version
        todo += [(Requirement(r), set(req.extras)) for r in dist.requires or []]
    return carry


def wheels() -> list[str]:
    """``NAME==VERSION`` of every wheel the pack carries, sorted."""
    return [f"{name}=={version}" for name, version in sorted(closure(declared(), image_packages()).items())]


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in wheels()))
