"""The layout and the import graph. Each subsystem has its room; imports run one way, from common and configs
through the drafter side, the serving-engine adapters, data, training and eval up to retraining and the command
line; nothing imports upward or in a circle (imports inside functions included), nothing edits sys.path, no module
reaches for another package's private names, and only the command line (scripts/cli/) defines `main`."""

import ast
import importlib
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A package may import its own modules and those of lower layers, never those of a layer above.
LAYERS = ["common", "configs", "drafters", "engines", "data", "train", "eval", "simulator", "retraining", "scripts"]
RANK = {name: i for i, name in enumerate(LAYERS)}
# The rooms, each a package of its own.
LAYOUT = {
    "drafters": {"drafter", "target", "decoding", "export"},
    "engines": {"hf", "vllm", "sglang"},
    "data": {"sources", "regeneration", "trajectory", "feature_cache", "tap"},
    "scripts": {"cli"},
}
# Files run by path (`accelerate launch train/dflash.py`, `python scripts/export.py`): entry points, not library.
LAUNCHERS = {"train/dflash.py", "scripts/export.py", "scripts/retrain.py", "scripts/testbed.py"}
LAUNCHER_MAX_LINES = 12


def _modules(packages) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO / pkg).rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


def test_every_project_package_has_a_layer_and_its_rooms():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages == set(LAYERS), f"packages without a layer (or layers without a package): {packages ^ set(LAYERS)}"
    for package, rooms in LAYOUT.items():
        found = {p.parent.name for p in (REPO / package).glob("*/__init__.py")}
        assert found == rooms, f"{package}/: {sorted(found)} instead of {sorted(rooms)}"
        loose = sorted(p.name for p in (REPO / package).glob("*.py") if p.name != "__init__.py")
        assert package not in ("drafters", "data") or loose == [], f"{package}/ modules outside a room: {loose}"


def test_no_import_runs_upward():
    upward = []
    for path in _modules(LAYERS):
        if str(path.relative_to(REPO)) in LAUNCHERS:
            continue
        own = path.relative_to(REPO).parts[0]
        for module, _, line in _imports(path):
            top = module.split(".")[0]
            if top in RANK and top != own and RANK[top] >= RANK[own]:
                upward.append(f"{_where(path, line)} ({own}) imports {module}")
    assert upward == []


def test_no_import_cycles_counting_imports_inside_functions():
    modules = {_name(p): p for p in _modules(LAYERS)}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, names, _ in _imports(path):
            edges |= {m for m in [module, *(f"{module}.{n}" for n in names)] if m in modules and m != name}
        graph[name] = edges
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_private_names_across_modules():
    reached = []
    for path in _modules(LAYERS + ["bench"]):
        this = _name(path)
        for module, names, line in _imports(path):
            if module.split(".")[0] in RANK and module != this:
                reached += [f"{_where(path, line)} imports {module}.{n}" for n in names if n.startswith("_")]
    assert reached == []


def test_no_sys_path_edits():
    edits = [_where(path, i) for path in _modules(LAYERS + ["bench", "tests"]) if path.name != Path(__file__).name
             for i, text in enumerate(path.read_text().splitlines(), 1) if "sys.path" in text]
    assert edits == []


def test_only_the_command_line_defines_main():
    mains = [_where(path, node.lineno) for path in _modules(LAYERS) if "cli" not in path.relative_to(REPO).parts[:2]
             for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("main")]
    assert mains == []


def test_launchers_are_thin_and_name_a_verb():
    from scripts.cli import VERBS

    for relative in LAUNCHERS:
        text = (REPO / relative).read_text()
        assert len(text.splitlines()) <= LAUNCHER_MAX_LINES, f"{relative}: library code belongs in a stage package"
        tree = ast.parse(text)
        assert [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))] == [], relative
        verb = text.split('main(["', 1)[1].split('"', 1)[0]
        assert verb in VERBS, f"{relative} calls an unknown verb {verb!r}"
    loose = {str(p.relative_to(REPO)) for p in (REPO / "scripts").glob("*.py") if p.name != "__init__.py"}
    assert loose <= LAUNCHERS, f"scripts/ holds more than the launchers: {sorted(loose - LAUNCHERS)}"


def test_every_verb_has_its_arguments_and_its_run():
    from scripts.cli import VERBS

    assert {"prepare", "train", "eval", "export", "retrain", "tap", "simulate", "plan"} <= set(VERBS)
    for verb, (module, _) in VERBS.items():
        loaded = importlib.import_module(f"scripts.cli.{module}")
        assert callable(loaded.add_arguments) and callable(loaded.run), verb
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"dflash-pipeline": "scripts.cli:main"}


def test_components_below_the_stages_take_their_own_config_sections():
    """The drafter side, the engine adapters and data take the sections they use (TargetConfig, DataConfig, ...);
    only the stages that join them (train, eval, retraining, the simulator, the command line) see the whole
    PipelineConfig."""
    whole = [_where(path, i) for path in _modules(["common", "drafters", "engines", "data"])
             for i, line in enumerate(path.read_text().splitlines(), 1) if "PipelineConfig" in line]
    assert whole == []
