"""ARCHITECTURE.md is the map of the package: every module is in its layer table, every module it names exists, and
the code's imports follow the table: none runs from a layer to one below it in the table, and none closes a circle.
The import graph is read from the source (every relative import, also inside functions), not from a running process.
"""

import ast
import re

from conftest import PROJECT

PACKAGE = PROJECT / "src" / "{{ cookiecutter.package_name }}"
MAP = PROJECT / "ARCHITECTURE.md"


def layers() -> dict[str, int]:
    """module -> its layer's number, from the map's table rows `| N. name | `a.py`, `b.py` | ... |`."""
    found = {}
    for number, modules in re.findall(r"^\| (\d+)\. [^|]+\| ([^|]+) \|", MAP.read_text(), re.M):
        for module in re.findall(r"`(\w+)\.py`", modules):
            found[module] = int(number)
    return found


def imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (relative imports anywhere in it)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph = {}
    for module in modules:
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        graph[module] = (names & modules) - {module}
    return graph


def test_the_map_names_every_module_once_and_only_modules_that_exist():
    mapped = layers()
    assert set(mapped) == set(imports()), "ARCHITECTURE.md's table and src/ list the same modules"
    assert len(MAP.read_text().splitlines()) <= 150, "a map, not a manual"


def test_no_import_runs_from_a_layer_to_one_below_it_in_the_map():
    mapped = layers()
    upward = [
        f"{module} (layer {mapped[module]}) imports {name} (layer {mapped[name]})"
        for module, names in imports().items()
        for name in names
        if mapped[name] > mapped[module]
    ]
    assert upward == []


def test_no_import_circle():
    graph = imports()
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for name in sorted(graph[module]):
            if name in path:
                circles.append(" -> ".join([*path[path.index(name) :], name]))
            elif name not in done:
                visit(name, [*path, name])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert circles == []


def test_every_path_and_name_the_map_gives_exists():
    text = MAP.read_text()
    for path in re.findall(r"`((?:tests|model_repository)/[\w/.]+)`", text):
        assert (PROJECT / path).exists(), path
    for module, name in re.findall(r"`(\w+)\.(\w+)", text):
        if name != "py" and (PACKAGE / f"{module}.py").is_file():
            assert re.search(rf"^(class|def) {name}\b|^{name} = ", (PACKAGE / f"{module}.py").read_text(), re.M), (
                f"{module}.{name}"
            )
