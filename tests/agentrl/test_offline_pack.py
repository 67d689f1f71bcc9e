"""The offline GPU pack carries everything the code imports that the GPU image lacks, and pyproject.toml
declares every package the code imports.

On 2026-12-04 the documented offline path (`scripts/offline_gpu.sh pack`, then `scripts/gpu_up.sh`) could not
start: `ModuleNotFoundError: No module named 'hiredis'` (imported by the gateway's store, missing from a
hand-kept wheel list). The list is now derived (scripts/offline_wheels.py); this walks the source with `ast`
for every third-party import of the packages that run there and checks each against it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_THERE = ("gateway", "engine", "trainer", "agents", "agentrl", "engines")  # what `agentrl up` runs
OURS = {"agentrl", "gateway", "engine", "engines", "trainer", "agents", "migrations", "tests", "bench"}


def _offline_wheels():
    spec = importlib.util.spec_from_file_location("offline_wheels", REPO / "scripts" / "offline_wheels.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside ``try: ... except ImportError`` (or ModuleNotFoundError): the code runs without it."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                    return True
    return False


def third_party_imports() -> dict[str, set[str]]:
    """top-level module -> the files importing it (module level and lazily in functions; not optional ones)."""
    found: dict[str, set[str]] = {}
    for package in RUN_THERE:
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in OURS or top == "__future__" or _optional(node, parents):
                        continue
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_the_walk_finds_what_broke_the_gpu_run():
    found = third_party_imports()
    assert "gateway/store/resp.py" in found["hiredis"] and "gateway/fasthttp.py" in found["httptools"]
    assert "datasets" not in found  # agents/datasets.py imports it under `except ImportError`: optional


def test_every_imported_package_is_declared_and_is_in_the_pack_or_the_image():
    wheels = _offline_wheels()
    declared = {wheels.canonical(r.name) for r in wheels.declared()}
    image = wheels.image_packages()
    pack = {line.split("==")[0] for line in wheels.wheels()}
    distributions = packages_distributions()
    problems = []
    for module, files in sorted(third_party_imports().items()):
        dists = {wheels.canonical(d) for d in distributions.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported by {sorted(files)[0]}) is not installed here")
            continue
        if not dists & declared:
            problems.append(f"{module} ({sorted(dists)}, imported by {sorted(files)[0]}) is not in pyproject's dependencies")
        if not dists & (pack | set(image)):
            problems.append(f"{module} ({sorted(dists)}) is neither in the offline pack nor in the GPU image's list")
    assert not problems, "\n".join(problems)


def test_the_pack_leaves_out_what_the_image_has_and_carries_what_it_lacks():
    wheels = _offline_wheels()
    pack = dict(line.split("==") for line in wheels.wheels())
    assert {"hiredis", "httptools", "fastapi", "sqlalchemy", "openai", "xgrammar"} <= set(pack)
    assert not {"torch", "transformers", "numpy", "safetensors", "triton"} & set(pack)  # the image's own
    from importlib.metadata import version

    assert pack["hiredis"] == version("hiredis")  # pinned to what the tests here ran with


def test_an_image_package_is_carried_when_a_requirement_needs_more_than_the_image_has(tmp_path):
    from packaging.requirements import Requirement

    wheels = _offline_wheels()
    image = {"numpy": "1.0.0", "tqdm": None, "torch": "2.11.0"}
    carried = wheels.closure([Requirement("numpy>=2"), Requirement("tqdm>=4"), Requirement("tqdm"),
                              Requirement("torch>=2.6")], image)
    assert set(carried) == {"numpy", "tqdm"}  # too old; a minimum on an unknown version; torch satisfies
    with pytest.raises(SystemExit, match="not installed here"):
        wheels.closure([Requirement("no-such-distribution-xyz")], {})
