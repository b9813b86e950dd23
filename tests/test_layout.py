"""The package's structure: imports flow one way, no module takes another's private names, no process labels.

Layers, lowest first (a module imports only from its own layer or below, and subpackages form no cycle):

0. ``errors``, ``jsonio``, ``console``, ``cache``, ``seeds``, ``version``, ``packages``, ``values``, ``lazy``
1. ``formats``, ``prompts``
2. ``solver``, ``engine``, ``drafters``, ``models``, ``grammar``
3. ``runtime``, ``profiler``, ``heads``
4. ``measure``, ``server``
5. ``commands``, ``cli``, ``__main__``
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "hsd_opt"
LAYERS = {
    "errors": 0, "jsonio": 0, "console": 0, "cache": 0, "seeds": 0, "version": 0, "packages": 0, "values": 0, "lazy": 0,
    "formats": 1, "prompts": 1,
    "solver": 2, "engine": 2, "drafters": 2, "models": 2, "grammar": 2,
    "runtime": 3, "profiler": 3, "heads": 3,
    "measure": 4, "server": 4,
    "commands": 5, "cli": 5, "__main__": 5,
}


def _unit(module: str) -> str | None:
    """``hsd_opt.solver.dp`` -> ``solver``; ``hsd_opt`` itself -> None (the package root re-exports)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hsd_opt" else None


@functools.lru_cache(maxsize=1)
def _parsed() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of the package, parsed once per test session: ``(dotted name, tree)``."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out.append((name, ast.parse(path.read_text(), str(path))))
    return tuple(out)


def _modules():
    """``(dotted name, tree)`` of every module of the package (the trees are shared: do not change them)."""
    return iter(_parsed())


def _imports(tree: ast.AST, module: str):
    """``(imported module, names)`` of every import anywhere in the module (functions included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = module.split(".")[: len(module.split(".")) - node.level + (1 if _is_pkg(module) else 0)]
                base = ".".join(pkg + ([base] if base else []))
            yield base, [a.name for a in node.names]


def _is_pkg(module: str) -> bool:
    return (REPO / Path(*module.split(".")) / "__init__.py").exists()


def test_every_module_has_a_layer():
    units = {_unit(m) for m, _ in _modules()} - {None}
    assert units <= set(LAYERS), f"add {sorted(units - set(LAYERS))} to LAYERS"


def test_imports_flow_down_the_layers():
    bad = []
    for mod, tree in _modules():
        src = _unit(mod)
        if src is None:
            continue
        for target, _ in _imports(tree, mod):
            dst = _unit(target)
            if dst is not None and dst != src and LAYERS[dst] > LAYERS[src]:
                bad.append(f"{mod} imports {target} (layer {LAYERS[dst]} above {LAYERS[src]})")
    assert not bad, "\n".join(bad)


def test_subpackages_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for mod, tree in _modules():
        src = _unit(mod)
        for target, _ in _imports(tree, mod):
            dst = _unit(target)
            if src and dst and dst != src:
                graph.setdefault(src, set()).add(dst)
    seen, stack = set(), []

    def visit(u):
        if u in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(u):] + [u]))
        if u in seen:
            return
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            visit(v)
        stack.pop()
        seen.add(u)

    for u in sorted(graph):
        visit(u)


def test_modules_inside_a_subpackage_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for mod, tree in _modules():
        for target, names in _imports(tree, mod):
            if not target.startswith("hsd_opt."):
                continue
            for t in [target] + [f"{target}.{n}" for n in names]:
                if (REPO / Path(*t.split("."))).with_suffix(".py").exists() and t != mod:
                    graph.setdefault(mod, set()).add(t)
    state: dict[str, int] = {}

    def visit(u, path):
        if state.get(u) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(u):] + [u]))
        if state.get(u) == 2:
            return
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            visit(v, path + [u])
        state[u] = 2

    for u in sorted(graph):
        visit(u, [])


def test_no_module_imports_from_the_package_root():
    """``hsd_opt/__init__.py`` re-exports from the layers; a module importing from it (``from hsd_opt import ...``,
    relative or not, or ``import hsd_opt``) would make an arrow that runs back up from every layer to the top."""
    bad = []
    for mod, tree in _modules():
        if mod == "hsd_opt":
            continue
        for target, names in _imports(tree, mod):
            if target == "hsd_opt":
                bad.append(f"{mod}: " + (f"from hsd_opt import {', '.join(names)}" if names else "import hsd_opt"))
    assert not bad, "\n".join(bad)


def test_no_module_takes_another_modules_private_names():
    bad = []
    for mod, tree in _modules():
        for target, names in _imports(tree, mod):
            if target.startswith("hsd_opt") and target != mod:
                bad += [f"{mod}: from {target} import {n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, "\n".join(bad)




def _extra_uses(tree: ast.AST):
    """``(line, code)`` of every ``X.extra`` in ``tree`` (read, written or called through: ``X.extra[...]``,
    ``X.extra.get(...)``, ``dict(X.extra)``), whatever ``X`` is: a plan, a profile, their provenance or a model
    entry. Code only: comments and strings are not looked at."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "extra":
            yield node.lineno, ast.unparse(node)


def test_the_extra_check_sees_reads_and_writes():
    code = ("a = plan.extra.get('models')\np.extra['by_task'] = {}\nb = dict(self.plan.extra)\n"
            "c = pl.extra['context']\nd = prof.extra['provenance']\ne = profile.provenance.extra.get('stats')\n"
            "f = extra['x']\n")
    assert sorted(line for line, _ in _extra_uses(ast.parse(code))) == [1, 2, 3, 4, 5, 6]


def test_only_formats_touches_the_untyped_fields():
    """No module of ``hsd_opt`` but ``formats`` touches an ``extra`` (by :func:`_extra_uses`): the sections of a
    plan and of a profile are typed attributes, parsed and validated when the file is loaded, and ``extra`` holds
    only the fields no code reads (kept for the round trip); a provenance's other fields are read through
    ``Provenance.get``."""
    bad = [f"{mod}:{line}: {code}" for mod, tree in _modules() if mod != "hsd_opt.formats"
           for line, code in _extra_uses(tree)]
    assert not bad, "use the typed fields of Plan, Profile and Provenance instead:\n" + "\n".join(bad)


#: The most lines a function of ``hsd_opt`` may take, from its ``def`` to its last line (decorators aside).
MAX_FUNCTION_LINES = 80
#: Functions allowed to be longer, by qualified name (``hsd_opt.solver.dp.dp_ranked``), each named in
#: docs/design.md with the reason it stays whole.
LONG_FUNCTIONS: set[str] = set()


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, lines)`` of every function in ``tree``: methods (``Class.name``) and nested functions
    (``outer.inner``) included, and those under an ``if``, ``try`` or ``with``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_the_function_length_check_sees_methods_and_nested_functions():
    code = ("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n"
            "if True:\n    async def h():\n        pass\n")
    assert sorted(_functions(ast.parse(code))) == [("A.f", 4), ("A.f.g", 2), ("h", 2)]


def test_no_function_is_longer_than_80_lines():
    """Every function of ``hsd_opt`` (methods and nested functions too) takes at most :data:`MAX_FUNCTION_LINES`
    lines: a long one is split by phase into helpers that do one thing, or named in :data:`LONG_FUNCTIONS` and in
    docs/design.md with the reason."""
    long = {f"{mod}.{name}": n for mod, tree in _modules() for name, n in _functions(tree) if n > MAX_FUNCTION_LINES}
    bad = [f"{q}: {n} lines" for q, n in sorted(long.items()) if q not in LONG_FUNCTIONS]
    assert not bad, (f"over {MAX_FUNCTION_LINES} lines: split by phase (or name it in LONG_FUNCTIONS and in "
                     f"docs/design.md with the reason):\n" + "\n".join(bad))
    design = (REPO / "docs" / "design.md").read_text()
    assert not [q for q in LONG_FUNCTIONS if q not in design], "name every LONG_FUNCTIONS entry in docs/design.md"
    stale = sorted(LONG_FUNCTIONS - set(long))
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines (take them out of LONG_FUNCTIONS): {stale}"


LOWER_LAYERS = ["hsd_opt.solver", "hsd_opt.engine.quantized", "hsd_opt.drafters", "hsd_opt.models.loading",
                "hsd_opt.heads", "hsd_opt.profiler.run", "hsd_opt.runtime.runner", "hsd_opt.measure.bench"]


def test_lower_layers_do_not_import_the_cli():
    """Importing the layers under the CLI, one after the other in a fresh interpreter, never imports typer,
    ``hsd_opt.cli`` or ``hsd_opt.commands`` (the first module that does is named)."""
    code = ("import importlib, sys\n"
            f"for m in {LOWER_LAYERS!r}:\n"
            "    importlib.import_module(m)\n"
            "    bad = [n for n in sys.modules if n in ('typer', 'hsd_opt.cli') or n.startswith('hsd_opt.commands')]\n"
            "    if bad:\n"
            "        print(m, 'imported', ','.join(bad)); break\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == ""


# Process labels have no meaning to a reader of the repository: papers are cited by title and arXiv id, the design
# by docs/design.md. (The patterns are assembled here so that this file does not match them itself.)
SHARED_NOTES = "DESIGN" + ".md"
LABELS = re.compile("|".join(["se" + r"ed 00[0-9]", "iss" + r"ue [0-9]", "the bri" + "ef", "we were giv" + "en",
                              re.escape(SHARED_NOTES)]), re.IGNORECASE)


def test_no_process_labels_in_the_repository():
    roots = [PKG, REPO / "tests", REPO / "benchmarks", REPO / "docs", REPO / "data", REPO / "README.md"]
    files = [p for r in roots for p in ([r] if r.is_file() else r.rglob("*"))
             if p.is_file() and p.suffix in (".py", ".md", ".toml", ".txt", ".json", ".jsonl")]
    hits = []
    for p in files:
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            for m in LABELS.finditer(line):
                if m.group(0) == SHARED_NOTES or m.group(0).lower() != SHARED_NOTES.lower():  # docs/design.md is ours
                    hits.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_package_ships_its_type_marker_and_suite():
    assert (PKG / "py.typed").is_file()
    assert (PKG / "data" / "prompts.jsonl").is_file()


def test_the_declared_licence_ships_its_text():
    """pyproject.toml declares Apache-2.0, and its text is the LICENSE file at the root, which setuptools puts in
    the wheel and the sdist (its default ``license-files``; none set otherwise)."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'(?m)^license = "Apache-2.0"$', pyproject) and "license-files" not in pyproject
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_version_is_the_projects():
    import hsd_opt
    from hsd_opt.version import __version__

    declared = re.search(r'(?m)^version = "([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert hsd_opt.__version__ == __version__ == declared


def test_no_torchscript_in_the_package():
    """One layer path per backend: the torch path and the C kernels. No TorchScript stack beside them."""
    jit = re.compile(r"\btorch\.jit\b|\bjit\.script\b")
    hits = [f"{p.relative_to(REPO)}:{i}" for p in sorted(PKG.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if jit.search(line)]
    assert not hits, "\n".join(hits)
