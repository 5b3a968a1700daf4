"""The layering of gnnpar's packages holds: imports go down the layer order written here
(docs/overview.md draws it), no two packages import each other, and the torch-free parts
import without torch.

Every ``import`` statement counts, those inside functions and under ``TYPE_CHECKING``
included: a lazy import is still a dependency. A unit is a package of gnnpar (``models``,
``tensor``...) or one of its top-level modules (``comm``, ``grid``...), and ``partitioners``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The layers, lowest first. A unit may import units of its own layer or of lower ones,
#: never of a higher one (and never in a cycle, whatever the layers).
LAYERS: tuple[tuple[str, ...], ...] = (
    # the kinds of error (a user's, a peer's), raised everywhere: imports nothing of gnnpar
    ("errors",),
    # plain helpers: formatting, files, numbers, no process group
    ("fmt", "atomic", "arrays", "chunking", "plotting", "recompute", "grad_destination",
     "allocation"),
    ("verified", "virtual_device", "launch", "failpoints"),
    # the process grid and the one door to torch.distributed
    ("shm", "grid"),
    ("comm", "testing", "info"),
    # data and the generic engines
    ("graph", "nn"),
    ("data",),
    ("partitioners",),
    ("sparse", "sampling", "checkpoint"),
    ("tensor",),
    ("shard", "compile"),
    ("pipeline",),
    # the planner's generic models, then the trainer and its registry
    ("plan",),
    ("train",),
    # workloads, then the command line above everything
    ("models",),
    ("cli",),
)

#: Imports that still go up, each with the reason it is there; the test fails when one
#: disappears (remove it here) as well as when a new one appears.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

#: Of the pairs above, those that are also a cycle (the other side imports back).
KNOWN_CYCLES: set[tuple[str, str]] = set()


def _unit(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    if parts[0] == "partitioners":
        return "partitioners"
    inner = parts[1:]
    return inner[0] if len(inner) > 1 else inner[0].removesuffix(".py")


def _imported(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every gnnpar or partitioners import in ``path``."""
    package = (path.relative_to(ROOT).with_suffix("")).parts[:-1]
    return _imports_of(path.read_text(), package, str(path))


def _imports_of(source: str, package: tuple[str, ...], name: str) -> list[tuple[str, int]]:
    """(module, line) of every gnnpar or partitioners import in ``source``, a module of
    ``package`` (its dotted parts, for relative imports)."""
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                keep = package[: len(package) - node.level + 1]
                base = ".".join([*keep, *([base] if base else [])])
            if base in ("gnnpar", "partitioners"):
                out += [(f"{base}.{n.name}", node.lineno) for n in node.names]
            elif base.startswith(("gnnpar.", "partitioners.")):
                out.append((base, node.lineno))
        elif isinstance(node, ast.Import):
            out += [
                (n.name, node.lineno)
                for n in node.names
                if n.name.startswith(("gnnpar.", "partitioners."))
            ]
    return out


def _target_unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "partitioners":
        return "partitioners"
    return parts[1] if len(parts) > 1 else None


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) → the ``file:line`` of each such import."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    files = [*(ROOT / "gnnpar").rglob("*.py"), *(ROOT / "partitioners").rglob("*.py")]
    for path in files:
        a = _unit(path)
        for module, line in _imported(path):
            b = _target_unit(module)
            if b is not None and b != a and b != "__version__":
                edges[(a, b)].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def _layer_of() -> dict[str, int]:
    return {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def test_every_unit_has_a_layer():
    layer = _layer_of()
    units = {a for a, _ in import_graph()} | {b for _, b in import_graph()}
    missing = sorted(units - set(layer))
    assert not missing, f"units without a layer in LAYERS: {missing}"


def test_imports_go_down_the_layers():
    layer = _layer_of()
    upward = {
        (a, b): where for (a, b), where in import_graph().items() if layer[b] > layer[a]
    }
    new = {pair: where for pair, where in upward.items() if pair not in KNOWN_UPWARD}
    assert not new, "imports from a lower layer up to a higher one:\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(where)}" for (a, b), where in sorted(new.items())
    )
    gone = sorted(set(KNOWN_UPWARD) - set(upward))
    assert not gone, f"no longer imported upwards, remove from KNOWN_UPWARD: {gone}"


def test_no_two_units_import_each_other():
    edges = import_graph()
    cycles = {tuple(sorted(pair)) for pair in edges if (pair[1], pair[0]) in edges}
    assert cycles <= KNOWN_CYCLES, "units that import each other: " + ", ".join(
        f"{a} <-> {b} ({', '.join(edges[(a, b)] + edges[(b, a)])})"
        for a, b in sorted(cycles - KNOWN_CYCLES)
    )
    assert KNOWN_CYCLES <= cycles, f"cycles gone, remove them: {sorted(KNOWN_CYCLES - cycles)}"


def test_engines_import_no_workload_and_nothing_imports_the_cli():
    """The generic engines never name a workload (gnnpar.models) and only the command line
    itself imports gnnpar.cli (the launch agent reaches it by name, as every rank does)."""
    layer = _layer_of()
    for (a, b), where in import_graph().items():
        if b == "cli":
            raise AssertionError(f"{a} imports the command line: {where}")
        if b == "models" and layer[a] < layer["models"] and (a, b) not in KNOWN_UPWARD:
            raise AssertionError(f"{a} imports a workload: {where}")


def test_the_layering_check_sees_lazy_and_relative_imports():
    """An import inside a function counts: a low module that lazily imports the trainer is
    an upward edge (what the mutant ``layering-lazy-upward-import`` adds, the test above
    reports); so does a relative one."""
    source = (
        "def late():\n    from gnnpar.train.loop import Trainer\n"
        "from ..models import gpt\n"
    )
    found = [(_target_unit(m), line) for m, line in _imports_of(source, ("gnnpar", "nn"), "x")]
    assert sorted(found) == [("models", 3), ("train", 2)]
    assert _layer_of()["train"] > _layer_of()["fmt"]


def test_partitioners_and_the_verified_folder_toolkit_import_without_torch():
    """docs/partitioners.md: the package needs torch only to read torch tensors."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import partitioners, partitioners.csr, partitioners.metrics, gnnpar.verified\n"
        "print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _private_imports() -> list[str]:
    """``file:line name`` of every private name one module imports from another (a private
    submodule imported inside its own package is that package's business)."""
    out = []
    files = [*(ROOT / "gnnpar").rglob("*.py"), *(ROOT / "partitioners").rglob("*.py")]
    for path in files:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] not in ("gnnpar", "partitioners"):
                continue
            for alias in node.names:
                name = alias.name
                own_submodule = node.module == package and (path.parent / f"{name}.py").exists()
                if name.startswith("_") and name != "__version__" and not own_submodule:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{name}")
    return out


def test_no_module_imports_another_modules_private_names():
    """Modules meet through public names only (a private one is free to change)."""
    found = _private_imports()
    assert not found, "private names imported across modules:\n  " + "\n  ".join(found)
