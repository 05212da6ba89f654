"""The package's dependencies run one way (lang -> compiler -> jit -> autotune -> kernels -> ops -> integrations
-> the command line) with no cycles, and no module imports another package's private (underscored) names:
read from the sources, function-level imports included."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tile_ops"
# each part of the package, and the parts it may import from (itself included)
# base: the compiled extension and the package's version, which any part may read; autotune sits below the
# kernels, which read its table, and its tune command (autotune.cli) is part of the command line, on top
LAYERS = ["base", "lang", "compiler", "jit", "autotune", "kernels", "ops", "integrations", "top"]


def _part(module: str) -> str:
    """The layer of ``tile_ops.<module>``: its subpackage (the tune command apart), else the top level."""
    parts = module.split(".")
    if parts[0] in ("_C", "__version__"):
        return "base"
    if parts[:2] == ["autotune", "cli"]:
        return "top"
    return parts[0] if parts[0] in LAYERS else "top"


def _imports(path: pathlib.Path):
    """(imported module under tile_ops, names) for every import of the file, relative ones resolved."""
    module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("tile_ops"):
                target = node.module.removeprefix("tile_ops").lstrip(".")
            else:
                continue
            yield module, target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tile_ops."):
                    yield module, a.name.removeprefix("tile_ops."), []


def _edges():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield from _imports(path)


def test_dependencies_run_one_way():
    wrong = []
    for module, target, names in _edges():
        src, dst = _part(module), _part(target or "top")
        if not target:  # `from tile_ops import x`: x is a subpackage or the top level
            dst = min((_part(n) for n in names), key=LAYERS.index, default="top")
            dst = "top" if all(_part(n) == "top" for n in names) else dst
        if LAYERS.index(dst) > LAYERS.index(src):
            wrong.append(f"{module} ({src}) imports {target or names} ({dst})")
    assert not wrong, "\n".join(wrong)


def test_no_private_names_cross_a_package():
    wrong = []
    for module, target, names in _edges():
        if _part(module) == _part(target or "top"):
            continue
        wrong += [f"{module} imports {target}.{n}" for n in names if n.startswith("_") and _part(n) != "base"]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module, layer", [("compiler.ops.copy", "compiler"), ("autotune.table", "autotune"),
                                           ("autotune.cli", "top"), ("_C", "base"), ("__main__", "top")])
def test_parts_are_named_by_their_package(module, layer):
    assert _part(module) == layer
