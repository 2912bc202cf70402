"""The import graph of ``data_tools/``, ``trainers/``, ``stages/`` and ``bench/``, read with ``ast``: every import,
also those inside functions and under ``TYPE_CHECKING``. No cycle between modules, and no import up the layers
``data_tools`` (the generation layer ``data_tools.generation`` included) < ``trainers`` < ``stages`` < ``bench``.

Edges as ``../shared/tools/importgraph.py`` draws them: ``import a.b`` depends on ``a.b``; ``from a.b import c``
on ``a.b`` and, when ``c`` is a module, on ``a.b.c``; a name resolves to the longest module prefix of it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: low to high: a module may import its own layer and the layers below it
LAYERS = ("data_tools", "trainers", "stages", "bench")


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the layers' folders of ``root`` (a package is its
    ``__init__``)."""
    mods = {}
    for top in LAYERS:
        for f in sorted((root / top).rglob("*.py")):
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported project module: line of its first import}."""
    mods = project_modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for n in names:
                t = resolve(n)
                if t is not None and t != m:
                    graph[m].setdefault(t, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def upward(graph: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """``(importer, imported, line)`` for every import of a module of a higher layer."""
    layer = {name: i for i, name in enumerate(LAYERS)}
    return sorted((a, b, line) for a, out in graph.items() for b, line in out.items()
                  if layer[b.split(".")[0]] > layer[a.split(".")[0]])


def test_the_project_has_no_import_cycle_and_no_upward_import():
    graph = import_graph(REPO)
    assert {"data_tools.generation.engines", "data_tools.generation.fast_decoder", "trainers.opd_trainer",
            "stages.curate", "bench.learning"} <= set(graph)
    # the layer below the trainer is used by the trainer and the stages (the walk sees these edges)
    assert "data_tools.generation.fast_decoder" in graph["trainers.async_rollouts"]
    assert "data_tools.generation.engines" in graph["stages.curate_sampling"]
    assert cycles(graph) == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(graph))
    assert upward(graph) == [], "imports up the layers data_tools < trainers < stages < bench: " + "; ".join(
        f"{project_modules(REPO)[a].relative_to(REPO)}:{line} imports {b}" for a, b, line in upward(graph))


def test_the_generation_stages_start_without_torch_and_import_the_engine_processes_at_top():
    """vLLM's spawned processes re-import the stage's main module, which must import ``processes`` at its top (they
    ask to die with the stage there); torch, transformers and vLLM load only where an engine starts, so a stage
    answers a bad flag at once."""
    for stage in ("curate", "evaluate"):
        body = ast.parse((REPO / "stages" / f"{stage}.py").read_text()).body
        assert any(isinstance(n, ast.ImportFrom) and n.module == "data_tools.generation.processes" for n in body), stage
    code = ("import sys, stages.curate, stages.evaluate\n"
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_walk_finds_cycles_and_upward_imports_inside_functions_and_relative(tmp_path):
    _tree(tmp_path, {
        "data_tools/__init__.py": "",
        "data_tools/low.py": "def f():\n    from trainers.mid import g  # upward, hidden in a function\n",
        "data_tools/pkg/__init__.py": "",
        "data_tools/pkg/a.py": "from . import b\n",  # relative: data_tools.pkg.b
        "data_tools/pkg/b.py": "import os\n\ndef h():\n    from data_tools.pkg.a import x\n",  # a <-> b
        "trainers/__init__.py": "",
        "trainers/mid.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stages import top\n",
        "stages/__init__.py": "",
        "stages/top.py": "import data_tools.pkg.a\nfrom bench.b1 import z\n",
        "bench/b1.py": "import stages.top\nfrom bench import b2\n",
        "bench/b2.py": "from bench.b1 import y\n",  # b1 <-> b2
    })
    graph = import_graph(tmp_path)
    assert graph["data_tools.pkg.a"] == {"data_tools.pkg": 1, "data_tools.pkg.b": 1}
    assert graph["data_tools.pkg.b"] == {"data_tools.pkg.a": 4}
    # b1 <-> b2 and b1 <-> stages.top share b1: one component
    assert cycles(graph) == [["bench.b1", "bench.b2", "stages.top"], ["data_tools.pkg.a", "data_tools.pkg.b"]]
    assert upward(graph) == [("data_tools.low", "trainers.mid", 2), ("stages.top", "bench.b1", 2),
                             ("trainers.mid", "stages", 3), ("trainers.mid", "stages.top", 3)]
    # none of it: no finding
    _tree(tmp_path, {"data_tools/low.py": "import os\n", "data_tools/pkg/b.py": "import os\n",
                     "trainers/mid.py": "from data_tools.pkg import a\n", "stages/top.py": "from trainers import mid\n",
                     "bench/b1.py": "import stages.top\n", "bench/b2.py": "from bench.b1 import y\n"})
    graph = import_graph(tmp_path)
    assert cycles(graph) == [] and upward(graph) == []
    assert graph["trainers.mid"] == {"data_tools.pkg": 1, "data_tools.pkg.a": 1}
