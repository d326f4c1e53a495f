"""Count the late (function-level) imports that cross the workbench's top-level packages.

    python tools/late_imports.py [--list] [PACKAGE_DIR]

A *late* import is an ``import`` / ``from ... import`` statement inside a function (or a method) rather than at
module level.  It *crosses packages* when the module it imports lies in another top-level package or module of
``workbench/`` than the importing file: ``workbench/rank/train.py`` importing ``workbench.checkpoint`` crosses
(``rank`` -> ``checkpoint``), importing ``workbench.rank.build`` does not.  A top-level module such as
``workbench/config.py`` is a package of its own here (``config``), as is each of ``config_fields.py``,
``layout.py``, ...

Each statement counts once per package it imports from (``from workbench import advisor, planner`` counts two,
``from workbench.checkpoint import a, b`` one), and once however deeply its function is nested.  Imports of
third-party packages (torch, megatron-core, matplotlib, ...) are not counted.

Prints the total, then the count of each (importing package, imported package) pair, largest first;
``--list`` also prints every such import as ``file:line  importer -> imported  (function)``.
ARCHITECTURE.md ("Layers") says why the ones that remain are late.  Exit status 0.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT_PACKAGE = "workbench"


class LateImport(NamedTuple):
    path: Path       # the importing file
    line: int
    function: str    # the innermost function holding the statement
    importer: str    # its top-level package (or module) of workbench/
    imported: str    # the top-level package (or module) it imports from


def _top(module: str) -> str | None:
    """``workbench.x.y`` -> ``x``; None for a module outside the package (or the package itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == ROOT_PACKAGE and len(parts) > 1 else None


def _imported_packages(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, root: Path) -> list[str]:
    """The top-level workbench packages one import statement (in ``module``) imports from, each once."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolved against the importing module's package
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[: len(here) - node.level + 1]
            base = ".".join(here + ([base] if base else []))
        if base == ROOT_PACKAGE:  # from workbench import x, y: each name a package or module of its own
            names = [f"{ROOT_PACKAGE}.{alias.name}" for alias in node.names
                     if (root / alias.name).is_dir() or (root / f"{alias.name}.py").is_file()]
        else:
            names = [base]
    found = []
    for name in names:
        top = _top(name)
        if top is not None and top not in found:
            found.append(top)
    return found


def _function_imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """(import statement, innermost enclosing function's name) for every import inside a function."""
    def visit(node: ast.AST, function: str | None) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, child.name)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                if function is not None:
                    yield child, function
            else:
                yield from visit(child, function)

    yield from visit(tree, None)


def late_imports(root: Path) -> list[LateImport]:
    """Every late cross-package import under the package directory ``root`` (``workbench/``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("").parts  # ("workbench", "rank", "train")
        is_package = rel[-1] == "__init__"
        module = ".".join(rel[:-1] if is_package else rel)
        importer = rel[1] if len(rel) > 1 and rel[1] != "__init__" else ""
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, function in _function_imports(tree):
            for imported in _imported_packages(node, module, is_package, root):
                if imported != importer:
                    out.append(LateImport(path, node.lineno, function, importer, imported))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1] / ROOT_PACKAGE),
                    help="the package directory (default: this repository's workbench/)")
    ap.add_argument("--list", action="store_true", help="print every late cross-package import")
    args = ap.parse_args(argv)
    root = Path(args.root)
    found = late_imports(root)
    print(len(found))
    pairs = collections.Counter((i.importer, i.imported) for i in found)
    for (importer, imported), n in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:4d}  {importer or ROOT_PACKAGE} -> {imported}")
    if args.list:
        print()
        for i in found:
            print(f"{i.path.relative_to(root.parent)}:{i.line}  {i.importer or ROOT_PACKAGE} -> {i.imported}  ({i.function})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
