"""The package's layers (docs/architecture.md): the shared modules at the top
use no subpackage, `mil/` uses only the shared modules, and no subpackage
uses `parity/`. Read from the sources, so an import that crosses a layer
fails here, naming the module and the import."""

from __future__ import annotations

import ast
from pathlib import Path

import chunkforge_py

ROOT = Path(chunkforge_py.__file__).parent
SUBPACKAGES = {"convert", "mil", "parity", "emulate", "quality"}
# What each part may import of the others (the shared modules are "").
ALLOWED = {
    "": set(),
    "mil": {""},
    "emulate": {"", "mil"},
    "convert": {"", "mil"},
    "parity": {"", "mil", "emulate"},
    "quality": {"", "mil", "emulate", "parity"},
}


def part_of(module: str) -> str:
    head = module.split(".")[0]
    return head if head in SUBPACKAGES else ""


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module under chunkforge_py) of every import in `path`."""
    here = path.relative_to(ROOT).with_suffix("").parts
    package = list(here[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [".".join([*target, a.name]) for a in node.names] if not node.module else [".".join(target)]
                found += [(node.lineno, n) for n in names]
            elif node.module and node.module.startswith("chunkforge_py."):
                found.append((node.lineno, node.module.removeprefix("chunkforge_py.")))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name.removeprefix("chunkforge_py."))
                for a in node.names
                if a.name.startswith("chunkforge_py.")
            ]
    return found


def crossings() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        part = rel.parts[0] if len(rel.parts) > 1 else ""
        for line, target in imports(path):
            other = part_of(target)
            if other != part and other not in ALLOWED[part]:
                bad.append(f"{rel}:{line} imports {target} ({part or 'shared'} may not use {other})")
    return bad


def test_each_part_imports_only_what_its_layer_may() -> None:
    assert crossings() == []


def test_the_check_sees_imports() -> None:
    # The reader finds the imports the rule is about, relative and absolute.
    found = {t for _, t in imports(ROOT / "parity" / "programs.py")}
    assert "emulate.release" in found and any(t.startswith("mil.") for t in found)
