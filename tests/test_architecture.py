"""The import graph runs one way: from common and configs through the drafter, data, training and eval stages
up to retraining and the command-line entry points. Nothing imports upward, nothing edits sys.path, no
module reaches for another module's private names, and scripts/ holds only thin entry points."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A package may import its own modules and those of lower layers, never those of its own layer or above.
LAYERS = ["common", "configs", "drafters", "data", "train", "eval", "simulator", "retraining", "scripts"]
RANK = {name: i for i, name in enumerate(LAYERS)}
SCRIPT_MAX_LINES = 12


def _modules(packages) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO / pkg).rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import of the file, top level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO)}:{line}"


def test_every_project_package_has_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages == set(LAYERS), f"packages without a layer (or layers without a package): {packages ^ set(LAYERS)}"


def test_no_import_runs_upward():
    upward = []
    for path in _modules(LAYERS):
        own = path.relative_to(REPO).parts[0]
        for module, _, line in _imports(path):
            top = module.split(".")[0]
            if top in RANK and top != own and RANK[top] >= RANK[own]:
                upward.append(f"{_where(path, line)} ({own}) imports {module}")
    assert upward == []


def test_no_private_names_across_modules():
    reached = []
    for path in _modules(LAYERS + ["bench"]):
        this = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for module, names, line in _imports(path):
            if module.split(".")[0] in RANK and module != this:
                reached += [f"{_where(path, line)} imports {module}.{n}" for n in names if n.startswith("_")]
    assert reached == []


def test_no_sys_path_edits():
    edits = [_where(path, i) for path in _modules(LAYERS + ["bench", "tests"]) if path.name != Path(__file__).name
             for i, text in enumerate(path.read_text().splitlines(), 1) if "sys.path" in text]
    assert edits == []


def test_scripts_are_thin_entry_points():
    for path in _modules(["scripts"]):
        if path.name == "__init__.py":
            continue
        lines = path.read_text().splitlines()
        assert len(lines) <= SCRIPT_MAX_LINES, f"{path.name} has {len(lines)} lines: library code belongs in a stage package"
        tree = ast.parse("\n".join(lines))
        defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defs == [], f"{path.name} defines {defs}"


def test_console_entry_points_name_real_functions():
    import importlib
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"dflash-train", "dflash-export", "dflash-retrain", "dflash-eval"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), f"{name} -> {target}"
