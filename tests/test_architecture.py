"""The shape of the package: no import circles between builder's modules and no module over 400 lines.

The import graph is read from the source with `ast`, imports inside functions included: an import hidden in a
function is still a circle in the design, it only fails later. An edge is an import a module names; the implicit
import of a parent package's __init__ is not one (a package re-exporting its modules is not a circle, but a module
importing its own package's __init__ is).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import builder

PACKAGE = Path(builder.__file__).parent
MAX_LINES = 400


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package` (a package is named by its __init__.py)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` it imports, anywhere in its source."""
    modules = module_files(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package, one level up per extra dot
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                targets += [f"{base}.{alias.name}" for alias in node.names]
        graph[name] = {module for target in targets if (module := _module_of(target, modules)) not in (None, name)}
    return graph


def _module_of(dotted: str, modules: dict[str, Path]) -> str | None:
    """The module that `dotted` (a module, or a name inside one) lives in, if it is one of `modules`."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each once, as the shortest chain from its first module back to it."""
    cycles: dict[frozenset[str], list[str]] = {}
    for start in sorted(graph):
        chain = _shortest_chain_back(graph, start)
        if chain is not None and frozenset(chain) not in cycles:
            cycles[frozenset(chain)] = chain
    return list(cycles.values())


def _shortest_chain_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    parents: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for imported in sorted(graph.get(node, ())):
            if imported == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parents[chain[-1]])
                return chain[::-1] + [start]
            if imported not in parents and imported != start:
                parents[imported] = node
                queue.append(imported)
    return None


def test_builder_has_no_import_cycles():
    cycles = import_cycles(import_graph(PACKAGE))
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(chain) for chain in cycles)


def test_no_builder_module_is_over_400_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_files(PACKAGE).items()}
    assert len(lengths) > 50  # the walk found the package
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root / "pkg"


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import helper\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "def helper():\n    from pkg import a\n    return a\n",
            "pkg/b.py": "from .sub import b\n",
            "pkg/c.py": "from . import a\nfrom .. import elsewhere\n",  # c is imported by nothing: no circle
        },
    )
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.b", "pkg.a"]]


def test_a_package_reexporting_its_modules_is_no_circle_but_importing_it_back_is(tmp_path):
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.core import run\nfrom pkg.util import helper\n",
            "pkg/core.py": "import os\nfrom pkg.util import helper\n\ndef run():\n    return helper()\n",
            "pkg/util.py": "def helper():\n    return 1\n",
        },
    )
    assert import_cycles(import_graph(package)) == []
    (package / "util.py").write_text("def helper():\n    from pkg import run\n    return run\n")
    assert ["pkg", "pkg.util", "pkg"] in import_cycles(import_graph(package))


# The stage contract, the models, records and the shared helpers of stages (`builder.stages._*`) are what a stage
# may use of the rest; another stage, the pipeline that wires them, and the model connection are not.
FORBIDDEN_FOR_STAGES = ("builder.pipeline", "builder.llm.connect", "builder.cli")
# What records.py may import: the evidence models, and modules that import nothing of builder but each other.
RECORD_LEAVES = {"builder", "builder.evidence", "builder.frozen", "builder.usage", "builder.sandbox.world"}


def _stage_of(module: str) -> str | None:
    """The stage a module belongs to (`builder.stages.<stage>`), None for a shared helper (`builder.stages._llm`)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["builder", "stages"] or parts[2].startswith("_"):
        return None
    return parts[2]


def stage_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        stage = _stage_of(module)
        if stage is None:
            continue
        for target in sorted(imported):
            other = _stage_of(target)
            if other is not None and other != stage:
                found.append(f"{module} imports the {other} stage ({target})")
            if any(target == banned or target.startswith(banned + ".") for banned in FORBIDDEN_FOR_STAGES):
                found.append(f"{module} imports {target}")
    return found


def test_no_stage_imports_another_stage_the_pipeline_or_the_model_connection():
    assert stage_violations(import_graph(PACKAGE)) == []


def test_records_import_only_records_and_evidence():
    graph = import_graph(PACKAGE)
    assert graph["builder.records"] <= RECORD_LEAVES, graph["builder.records"] - RECORD_LEAVES
    for leaf in RECORD_LEAVES - {"builder", "builder.evidence"}:
        assert graph[leaf] <= {"builder.frozen"}, f"{leaf} imports {graph[leaf]}"
    assert graph["builder.evidence"] <= {"builder.frozen", "builder.sandbox.world"}


def test_the_stage_rule_catches_a_stage_importing_another(tmp_path):
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/stages/__init__.py": "",
            "pkg/stages/_llm.py": "",
            "pkg/stages/scenarios/__init__.py": "from pkg.stages._llm import x\n",
            "pkg/stages/rollout.py": "def f():\n    from pkg.stages.scenarios import y\n    import pkg.pipeline\n",
            "pkg/pipeline.py": "",
        },
    )
    graph = {name.replace("pkg.", "builder.", 1): {t.replace("pkg.", "builder.", 1) for t in targets}
             for name, targets in import_graph(package).items()}  # fmt: skip
    assert stage_violations(graph) == [
        "builder.stages.rollout imports builder.pipeline",
        "builder.stages.rollout imports the scenarios stage (builder.stages.scenarios)",
    ]
