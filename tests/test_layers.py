"""The house follows the data flow: imports run down the layers, no cycle, imports at the top.

Read from the code itself (every ``import`` statement, at any depth), so a new upward import
or cycle fails here; docs/architecture.md draws the same layers. Also: the CLI's defaults are
the request models' (one source for every default).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest
import typer.main

from pipeplan.cli import app
from pipeplan.requests import ClusterRequest, PipelineRequest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeplan"

#: Each part of pipeplan and its layer, keyed by dotted module prefix under ``pipeplan`` ("*" stands
#: for one name): a module takes the layer of its longest matching key, and may import its own
#: layer (without a cycle) and the layers below it, never one above. A launcher's home
#: (``launchers.<name>``) is split across layers: its record at facts' level, its writer at
#: export's, its reader at doctor's; each of its modules needs a key of its own.
LAYERS = {
    "": 0, "errors": 0, "quantities": 0, "progress": 0,   # ground
    "facts": 1,                                    # schedules, GPUs, training state per parameter
    "launchers": 1, "launchers.*": 1,              # the homes' faces: docstrings, no imports
    "launchers.record": 1, "launchers.*.record": 1, "launchers.registry": 1,  # what each launcher runs
    "formats": 2,                                  # file models
    "requests": 3,                                 # what a caller asks for
    "profile": 4, "analytic": 4, "importers": 4,   # profiles in
    "plan": 5,                                     # graph, cost model, solvers, simulator, search
    "cluster": 6,                                  # layouts around the pipeline search
    "api": 7,                                      # every planning entry point, the dispatch
    "run": 8, "export": 8,                         # consumers of a plan
    "launchers.common": 8, "launchers.degrees": 8, "launchers.*.writer": 8,  # a plan in a launcher's words
    "check": 9, "doctor": 9,                       # consumers that re-plan and export
    "launchers.config": 9, "launchers.*.reader": 9, "launchers.*.checks": 9,  # its file in pipeplan's words
    "launchers.megatron.shell": 9, "launchers.megatron.shell_arith": 9, "launchers.megatron.shell_lex": 9,
    "launchers.torchtitan.inputs": 9, "launchers.editing": 9, "launchers.*.fix": 9,  # --fix, per launcher
    "show": 10, "cli_common": 10, "cli_run": 10, "cli": 10, "__main__": 10,
}

#: Parts whose every module must match a key of its own full length (no fallback to the part's
#: key), so that a new module there is placed on purpose.
STRICT_PARTS = ("launchers",)

#: Packages whose functions may import other pipeplan modules: they reach torch, which stays
#: lazy so that planning needs no torch (docs/architecture.md).
LAZY_FOR_TORCH = ("profile", "run")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports():
    """(importer, imported module, line, inside a function) for every pipeplan import."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "pipeplan" and target != name:
                    while target not in modules and "." in target:
                        target = target.rpartition(".")[0]
                    out.append((name, target, node.lineno, id(node) in inner))
                    out += [(name, face, node.lineno, id(node) in inner) for face in _faces_run(name, target)]
    return modules, out


def _faces_run(importer: str, target: str) -> list[str]:
    """The package faces (``__init__``) that importing ``target`` from ``importer`` runs first: every
    package above ``target`` that is not also above (or) ``importer``, whose face is already running.
    A face that imports back what imports into its package is a cycle that Python meets at run time
    (a partially initialised module), though no explicit import closes it."""
    parts = target.split(".")
    faces = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [f for f in faces if importer != f and not importer.startswith(f + ".")]


def _matches(key: str, names: list[str]) -> bool:
    keys = key.split(".") if key else []
    return len(keys) <= len(names) and all(k in ("*", n) for k, n in zip(keys, names))


def _part(module: str) -> str:
    """The ``LAYERS`` key of a module: its longest matching dotted prefix under ``pipeplan``."""
    names = module.split(".")[1:]
    matching = [key for key in LAYERS if _matches(key, names)]
    # Longest first; at one length a name beats "*".
    return max(matching, key=lambda key: (len(key.split(".")), -key.count("*")) if key else (0, 0)) \
        if matching else "?"


MODULES, IMPORTS = _imports()


def test_every_part_has_a_layer():
    assert {_part(m) for m in MODULES} <= set(LAYERS)
    strict = [m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] in STRICT_PARTS
              and len(_part(m).split(".")) != len(m.split(".")) - 1]
    assert strict == []


def test_layer_keys_are_used():
    """A key no module matches is a stale layer (a moved module's old place)."""
    assert {key for key in LAYERS if key} - {_part(m) for m in MODULES} == set()


def test_a_launchers_record_loads_no_reader_or_writer():
    """Importing what a launcher runs (as the planner's search does) stays at facts' level."""
    import subprocess
    import sys

    code = ("import sys, pipeplan.launchers.registry; "
            "print(sorted(m for m in sys.modules if m.startswith(('pipeplan.doctor', 'pipeplan.export')) "
            "or m.endswith(('.reader', '.writer'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_no_import_runs_up_the_layers():
    upward = [f"{a} -> {b} (line {line})" for a, b, line, _ in IMPORTS if LAYERS[_part(b)] > LAYERS[_part(a)]]
    assert upward == []


def test_no_import_cycle():
    graph = nx.DiGraph((a, b) for a, b, _, _ in IMPORTS)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == []
    parts = nx.DiGraph((_part(a), _part(b)) for a, b, _, _ in IMPORTS if _part(a) != _part(b))
    assert [sorted(c) for c in nx.strongly_connected_components(parts) if len(c) > 1] == []


def test_an_import_runs_the_faces_above_its_target():
    """Importing ``pipeplan.export.common`` from outside ``export/`` runs ``export/__init__`` first
    (so a face importing back is a cycle); from inside, the face is already running."""
    assert _faces_run("pipeplan.launchers.megatron.writer", "pipeplan.export.common") == ["pipeplan.export"]
    assert _faces_run("pipeplan.export.torch_pipelining", "pipeplan.export.common") == []
    assert _faces_run("pipeplan.doctor", "pipeplan.launchers.megatron.reader") == ["pipeplan.launchers",
                                                                                   "pipeplan.launchers.megatron"]
    assert _part("pipeplan.launchers.megatron.record") == "launchers.*.record"
    assert _part("pipeplan.launchers.registry") == "launchers.registry" and _part("pipeplan.cli") == "cli"


def test_imports_between_modules_sit_at_the_top():
    inside = [f"{a} -> {b} (line {line})" for a, b, line, nested in IMPORTS
              if nested and _part(a) not in LAZY_FOR_TORCH]
    assert inside == []


def test_no_package_face_loads_names_through_importlib():
    faces = [m for m, p in MODULES.items() if p.name == "__init__.py" and "importlib" in p.read_text()]
    assert faces == []


def test_planning_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, pipeplan.cli, pipeplan.api; print('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def _options(command: str) -> dict:
    click_command = typer.main.get_command(app).commands[command]
    return {p.name: p.default for p in click_command.params}


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_cli_defaults_are_the_request_defaults(command):
    """Every option of ``plan`` (and ``compare``) that a request field carries defaults to that
    field's default (bandwidth written as text: 25GB/s is the field's 25e9)."""
    from pipeplan.quantities import parse_bandwidth

    names = {"memory_cap": "memory_cap_bytes", "bandwidth": "bandwidth_bytes_per_s", "gpus": "num_gpus",
             "zero": "zero_stage"}
    compared = 0
    for option, default in _options(command).items():
        field = names.get(option, option)
        for model in (PipelineRequest, ClusterRequest):
            if field not in model.model_fields or field in ("stages", "schedule") and command == "compare":
                continue
            if model.model_fields[field].is_required():
                continue  # required in that request: the CLI's None means "not this kind"
            expected = model.model_fields[field].default
            if option == "bandwidth":
                default = parse_bandwidth(default)
            assert default == expected, (command, option, model.__name__)
            compared += 1
    assert compared >= 8


def _function_lengths():
    """(module, function, lines of code, whether it says why it is long) for every function."""
    for name, path in MODULES.items():
        source = path.read_text()
        lines = source.split("\n")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
            start = first.end_lineno if docstring else first.lineno - 1
            body = [line for line in lines[start:node.end_lineno] if line.strip() and not line.strip().startswith("#")]
            reason = any("Function length" in line for line in lines[node.lineno - 1:node.end_lineno])
            yield name, node.name, len(body), reason


def test_no_module_over_600_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in long.items() if n > 600} == {}


def test_no_function_over_about_80_lines_without_a_reason():
    """Docstrings, blank lines and comments aside; a longer one says why ("Function length: ...")."""
    assert [(m, f, n) for m, f, n, reason in _function_lengths() if n > 85 and not reason] == []
