"""The house rules a newcomer relies on: imports flow one way (config -> data, models, solver ->
stats, checkpoint, tracking -> evaluation -> engine -> cli), no import circle, no file past 400
lines, and no helper process of our own anywhere in the package."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trainer"
# The layer of each top-level piece: a module may import its own layer's pieces and lower ones.
LAYERS = {"errors": 0, "atomic_write": 0, "hashing": 0, "torch_load": 0, "daemon_call": 0, "redaction": 0, "logs": 0,
          "config_yaml": 0, "lr_policy": 0, "config_checks": 0, "detectron_keys": 0, "config_detectron": 0, "config": 0,
          "job_identity": 0, "cpu_quota": 0,
          "data": 1, "downloads": 1, "models": 1, "solver": 1, "distributed": 1, "preemption": 1, "output_lock": 1,
          "open_files": 1, "inference": 1, "visualize": 1,
          "stats": 2, "checkpoint": 2, "tracking": 2,
          "evaluation": 3, "lineage": 3, "output_dir": 3,
          "predict": 4, "publish": 4, "dry_run": 4, "explain": 4, "preflight": 4, "job": 4, "resume": 4, "engine": 4,
          "status": 5, "launch": 5, "cli": 6, "__main__": 7}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every trainer module `path` imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "trainer"}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _piece(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_imports_flow_one_way():
    wrong = [(a, b) for a, deps in _graph().items() for b in deps
             if _piece(a) and _piece(b) and LAYERS[_piece(b)] > LAYERS[_piece(a)]]
    assert not wrong, f"imports against the flow: {wrong}"


def test_no_import_circle():
    graph = _graph()

    def walk(node: str, path: list[str]) -> list[str] | None:
        for nxt in graph[node]:
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if (circle := walk(nxt, path + [nxt])) is not None:
                return circle
        return None

    for module in graph:
        assert walk(module, [module]) is None, f"import circle: {' -> '.join(walk(module, [module]))}"


def test_every_piece_has_a_layer_and_no_file_is_past_400_lines():
    assert {_piece(m) for m in _modules() if _piece(m)} <= set(LAYERS)
    long = {p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_readmes_layout_names_every_module():
    readme = (PACKAGE.parent / "README.md").read_text()
    drawing = readme[readme.index("## Layout"):].split("```")[1]
    unnamed = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if not p.name.startswith("__") and p.name not in drawing)
    assert not unnamed, f"README's layout does not name {unnamed}"


def test_the_package_starts_no_process_of_its_own():
    """Background work is threads of the training process (torchrun and DataLoader aside)."""
    spawners = ("subprocess.Popen", "multiprocessing.Process", "multiprocessing.Pool", "get_context(", "import Process",
                "import Pool", "ProcessPoolExecutor", "os.fork", "os.posix_spawn", "memfd_create")
    found = {(p.name, s) for p in PACKAGE.rglob("*.py") for s in spawners if s in p.read_text()}
    assert not found, found
