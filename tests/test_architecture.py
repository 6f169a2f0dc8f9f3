"""The package's import graph: one direction (formats -> layers -> models -> generation -> faces),
no cycles, every module a size a reader can hold (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each module of the installed package lives in the source tree.
SOURCES = {"bitnest_mlx": ROOT / "bitnest_mlx", "bitnest_mlx.models": ROOT / "models"}

# Rank of each part: a module may import parts of its own rank or lower, never higher.
RANKS = {
    "formats": 0,  # pure I/O and validation
    "hub": 0,  # org/repo -> local directory (file-level knowledge only)
    "kernels": 1,  # Metal launches; told their reference by the layers
    "layers": 2,  # storage formats as nn.Modules and caches
    "models": 3,  # architectures
    "convert": 4,  # float weights -> packages, calibrated through the models' own forward
    "sampling": 4,
    "speculative": 4,
    "evaluation": 4,
    "chips": 0,  # Apple GPU facts: bandwidth, cores, clocks
    "roofline": 4,  # bytes per token and the draft-KV policy
    "speed_model": 4,  # v(M) and what a round of speculation costs
    "prompt_lookup": 4,  # n-gram drafts from the context
    "draft_control": 4,  # each round's plan: chain, copy, copy + chain, target-only
    "draftless": 4,  # models with no draft plane (DeepSeek-V4) in the speculative loop
    "workloads": 4,  # bench --workloads' prompts and runs
    "loader": 4,
    "dsv4": 4,
    "dsv4_bench": 4,  # DeepSeek-V4 memory, bytes and per-part timing for bench
    "demo": 4,
    "mlx_lm_plugin": 5,  # faces
    "mlx_lm_speculation": 5,  # mlx-lm's speculative contract, for the plugin
    "cli": 5,
    "generate": 5,
    "chat": 5,
    "upload": 5,
    "publish": 4,  # the model card and the Hub upload of a package or bundle
    "eval": 5,
    "bench": 5,
    "server": 5,
    "verify": 5,
    "doctor": 5,  # bitnest-doctor's shim
    "__main__": 5,
    "__init__": 5,  # the lazy public API
}


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in SOURCES.items():
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
    if name.endswith(".__main__"):  # `python -m` entry points are faces wherever they sit
        return "__main__"
    if name.startswith("bitnest_mlx.models"):
        return "models"
    return name.split(".")[1]


def test_every_part_of_the_package_has_a_rank():
    assert {part(m) for m in graph()} <= set(RANKS), "give new top-level modules a rank"


def test_imports_go_one_way_only():
    wrong = [
        f"{a} (rank {RANKS[part(a)]}) imports {b} (rank {RANKS[part(b)]})"
        for a, targets in graph().items()
        for b in targets
        if RANKS[part(b)] > RANKS[part(a)]
    ]
    assert not wrong, "\n".join(wrong)


def test_named_forbidden_directions_are_absent():
    rules = {
        "formats": ("layers", "models", "kernels"),
        "layers": ("models",),
        "kernels": ("layers", "models"),
        "models": ("cli", "generate", "eval", "bench", "server", "loader", "speculative"),
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


def test_every_module_is_under_450_lines():
    long = {
        name: n
        for name, f in module_files().items()
        if (n := len(f.read_text(encoding="utf-8").splitlines())) >= 450
    }
    assert not long, long
