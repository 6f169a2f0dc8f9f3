"""The package's import graph: one direction (formats -> kernels -> layers -> models ->
converter -> runtime -> measurement -> mlx-lm integration / faces), no cycles, every module a
size a reader can hold (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each module of the installed package lives in the source tree; a path to a file is a
# top-level module (the startup hook, installed beside the package by setup.py).
SOURCES = {
    "bitnest_mlx": ROOT / "bitnest_mlx",
    "bitnest_mlx.models": ROOT / "models",
    "bitnest_mlx_hook": ROOT / "bitnest_mlx_hook.py",
}

# Rank of each part: a module may import parts of its own rank or lower, never higher.
RANKS = {
    "formats": 0,  # pure I/O and validation
    "hub": 0,  # org/repo -> local directory (file-level knowledge only)
    "kernels": 1,  # Metal launches; told their reference by the layers
    "layers": 2,  # storage formats as nn.Modules and caches
    "models": 3,  # architectures
    # float weights -> packages, calibrated through the models' own forward; above its rank it
    # may import CONVERTER_API and nothing else
    "convert": 4,
    # loading, generation (speculative loop, sampling, drafts) and the costs it plans with
    # (bytes per token, the draft-KV policy, v(M) on the chips' facts)
    "runtime": 5,
    "measurement": 6,  # what bench and eval report: roofline, evaluation, workloads, projections
    "mlx_lm_integration": 7,  # mlx-lm's commands and server on our models (a face)
    "cli": 7,  # the commands' argument parsing, main and printing
    "generate": 7,  # `python -m bitnest_mlx.<name>` shims
    "chat": 7,
    "eval": 7,
    "bench": 7,
    "server": 7,
    "upload": 7,
    "verify": 7,
    "doctor": 7,
    "dsv4": 7,  # `python -m bitnest_mlx.dsv4 make-bundle`
    "__main__": 7,
    "__init__": 7,  # the lazy public API
    "bitnest_mlx_hook": 8,  # the .pth's startup hook: stdlib only, hands over to the integration
}
# The converter's one way into the runtime: load a package and score a draft vocabulary.
CONVERTER_API = "bitnest_mlx.measurement.draft_vocab_score"
# What the startup hook may import of ours (lazily: at startup it imports the stdlib only).
HOOK_MAY_IMPORT = "bitnest_mlx.mlx_lm_integration"


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in SOURCES.items():
        if folder.suffix == ".py":
            if folder.exists():
                files[package] = folder
            continue
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([package, *parts])] = f
    return files


def imports_of(name: str, f: Path, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports anywhere in its body (functions included)."""
    is_package = f.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base.split(".")[: len(base.split(".")) - node.level + 1]
                mod = ".".join(up + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, f, known) for name, f in files.items()}


def part(name: str) -> str:
    if name == "bitnest_mlx":
        return "__init__"
    if name == "bitnest_mlx_hook":
        return name
    if name.endswith(".__main__"):  # `python -m` entry points are faces wherever they sit
        return "__main__"
    if name.startswith("bitnest_mlx.models"):
        return "models"
    return name.split(".")[1]


def allowed(a: str, b: str) -> bool:
    """May module `a` import module `b`? Its rank or lower; the converter also CONVERTER_API."""
    return RANKS[part(b)] <= RANKS[part(a)] or (part(a) == "convert" and b == CONVERTER_API)


def test_every_part_of_the_package_has_a_rank():
    assert {part(m) for m in graph()} <= set(RANKS), "give new top-level modules a rank"


def test_every_module_is_in_the_graph():
    """Every .py under bitnest_mlx/ and models/, and the startup hook."""
    files = module_files()
    want = {*(ROOT / "bitnest_mlx").rglob("*.py"), *(ROOT / "models").rglob("*.py")}
    assert set(files.values()) == {*want, ROOT / "bitnest_mlx_hook.py"}


def test_imports_go_one_way_only():
    wrong = [
        f"{a} (rank {RANKS[part(a)]}) imports {b} (rank {RANKS[part(b)]})"
        for a, targets in graph().items()
        for b in targets
        if not allowed(a, b)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_converter_reaches_the_runtime_through_one_module():
    """Above its rank the converter imports CONVERTER_API only (one function: load a package and
    score a draft vocabulary), and that module exists."""
    g = graph()
    assert CONVERTER_API in g
    above = {
        b
        for a, targets in g.items()
        if part(a) == "convert"
        for b in targets
        if RANKS[part(b)] > RANKS["convert"]
    }
    assert above == {CONVERTER_API}
    assert not any(part(b) == "convert" for b in g[CONVERTER_API] if b != CONVERTER_API)


def test_the_startup_hook_imports_the_stdlib_and_lazily_the_integration_only():
    """bitnest_mlx_hook runs at every Python startup (the .pth): at module level it imports the
    standard library only; inside functions, the mlx-lm integration subpackage and nothing else
    of ours or any third party's."""
    tree = ast.parse(SOURCES["bitnest_mlx_hook"].read_text(encoding="utf-8"))
    lazy = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f)
    }
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else ["<relative>"]
            if node.module == "bitnest_mlx":
                names = [f"bitnest_mlx.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            ours = name == HOOK_MAY_IMPORT or name.startswith(HOOK_MAY_IMPORT + ".")
            stdlib = name.split(".")[0] in sys.stdlib_module_names or name == "__future__"
            if not (stdlib or (ours and id(node) in lazy)):
                wrong.append(f"line {node.lineno}: {name}")
    assert not wrong, wrong


def test_named_forbidden_directions_are_absent():
    rules = {
        "formats": ("layers", "models", "kernels"),
        "layers": ("models",),
        "kernels": ("layers", "models"),
        "models": ("cli", "generate", "eval", "bench", "server", "runtime", "measurement"),
        "runtime": ("measurement", "mlx_lm_integration", "cli"),
        "measurement": ("mlx_lm_integration", "cli"),
        "convert": ("runtime", "mlx_lm_integration", "cli"),
    }
    g = graph()
    for a, targets in g.items():
        for b in targets:
            assert part(b) not in rules.get(part(a), ()), f"{a} imports {b}"


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_a_planted_cycle_and_a_wrong_direction(tmp_path, monkeypatch):
    pkg = tmp_path / "bitnest_mlx"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text("from .layers import thing\n")
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "layers" / "thing.py").write_text("def f():\n    from .. import kernels\n")
    monkeypatch.setattr(
        "test_architecture.SOURCES", {"bitnest_mlx": pkg, "bitnest_mlx.models": tmp_path / "none"}
    )
    g = graph()
    assert g["bitnest_mlx.kernels"] == {"bitnest_mlx.layers.thing"}
    assert g["bitnest_mlx.layers.thing"] == {"bitnest_mlx.kernels"}
    with pytest.raises(AssertionError):
        test_imports_go_one_way_only()
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()


def test_the_checker_lets_the_converter_import_its_one_module_above_and_nothing_else(
    tmp_path, monkeypatch
):
    pkg = tmp_path / "bitnest_mlx"
    for sub in ("convert", "runtime", "measurement"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "loader.py").write_text("")
    (pkg / "measurement" / "draft_vocab_score.py").write_text("from ..runtime import loader\n")
    (pkg / "convert" / "draft_vocab.py").write_text(
        "def f():\n    from ..measurement.draft_vocab_score import score_draft_vocabulary\n"
    )
    monkeypatch.setattr(
        "test_architecture.SOURCES", {"bitnest_mlx": pkg, "bitnest_mlx.models": tmp_path / "none"}
    )
    test_imports_go_one_way_only()
    test_the_converter_reaches_the_runtime_through_one_module()
    (pkg / "convert" / "calibrate.py").write_text("from ..runtime.loader import load\n")
    with pytest.raises(AssertionError, match="convert.calibrate .rank 4. imports"):
        test_imports_go_one_way_only()
    with pytest.raises(AssertionError):
        test_the_converter_reaches_the_runtime_through_one_module()


def test_every_module_is_under_450_lines():
    long = {
        name: n
        for name, f in module_files().items()
        if (n := len(f.read_text(encoding="utf-8").splitlines())) >= 450
    }
    assert not long, long


def long_functions(limit: int = 60) -> dict[str, int]:
    """`module.function` -> lines (signature and docstring included) of each one over `limit`."""
    found = {}
    for name, f in module_files().items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > limit:
                    found[f"{name}.{node.name}"] = n
    return found


def test_no_function_is_over_60_lines():
    assert not long_functions(), long_functions()


def test_the_function_length_check_sees_a_long_function(tmp_path, monkeypatch):
    pkg = tmp_path / "bitnest_mlx"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (pkg / "long.py").write_text(f"def steps():\n{body}")
    monkeypatch.setitem(SOURCES, "bitnest_mlx", pkg)
    assert long_functions() == {"bitnest_mlx.long.steps": 61}


def change_table() -> dict[str, str]:
    """docs/architecture.md's "Where a change goes": change -> the cell naming its place."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Where a change goes", 1)[1].split("\n\n")[1]
    rows = [line.split(" | ", 1) for line in table.splitlines()[2:]]
    return {change.strip("| *"): place for change, place in rows}


def test_the_change_table_names_an_existing_file_for_each_kind_of_change():
    table = change_table()
    for kind in (
        "a new model family",
        "a new storage format",
        "a new kernel",
        "a new CLI flag",
        "a new converter method",
        "a new benchmark",
    ):
        assert any(change.startswith(kind) for change in table), kind
    for change, place in table.items():
        for path in re.findall(r"`([\w./]+/[\w.]+\.(?:py|metal|md|json))`", place):
            here = [ROOT / path, ROOT / "bitnest_mlx" / path]
            assert any(p.exists() for p in here), f"{change}: {path} does not exist"
