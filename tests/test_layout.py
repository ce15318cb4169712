"""The house rules, checked on the source: imports flow one way, nobody reaches into another
object's private members, and the top-level kernels/ and model_cards/ install through pyproject alone."""

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_deltazip"
# top-level folders that install as subpackages (pyproject's package-dir)
MAPPED = {"kernels": f"{PACKAGE}.kernels", "model_cards": f"{PACKAGE}.model_cards"}
# layers allowed to import the benchmark code: the benchmarks themselves and the command line on top
BENCH_USERS = (f"{PACKAGE}.bench", f"{PACKAGE}.cli")
# private members of other libraries that the code uses on purpose
FOREIGN_PRIVATE = {
    "_version",  # torch.Tensor._version: in-place change counter
    "_weight_int4pack_mm", "_convert_weight_to_int4pack",  # torch's int4 baseline in the kernel bench
    "_getframe",
    "_attn_implementation",  # transformers' config: which attention function a model runs (no public getter)
    "_patch_lang_tensor",  # Triton's interpreter: wrapped for NumPy 2.4 on Triton 3.6 (kernels/_interpreter_compat.py)
    "_reinterpret",  # Gluon (experimental): a shared-memory buffer viewed with another layout; no public form in 3.6
    "_functorch",  # torch._C._functorch.is_batchedtensor: a fused norm under vmap (a delta's per-row weights) runs its own forward
}


def _source_modules() -> dict:
    """Module name -> path, for the package and the folders mapped into it."""
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    for folder, name in MAPPED.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


MODULES = _source_modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set:
    """Modules of ours that ``name`` imports anywhere (top level or inside functions), with the packages
    whose ``__init__`` runs on the way."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in MODULES and candidate != name:
                    found.add(candidate)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def test_the_import_graph_has_no_cycles():
    # a module's parent packages are imported before it anyway: that edge is how packages work
    def edges(name):
        return {t for t in GRAPH[name] if not (name.startswith(t + ".") and _is_package(t))}

    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(edges(n)):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_library_code_never_imports_the_benchmarks():
    bad = sorted(
        f"{n} imports {t}" for n, ts in GRAPH.items() for t in ts
        if _within(t, f"{PACKAGE}.bench") and not any(_within(n, user) for user in BENCH_USERS)
    )
    assert not bad, bad


def test_kernels_depend_only_on_the_packing_primitives():
    bad = sorted(
        f"{n} imports {t}" for n, ts in GRAPH.items() if n.startswith(f"{PACKAGE}.kernels")
        for t in ts if not t.startswith(f"{PACKAGE}.kernels") and t not in (PACKAGE, f"{PACKAGE}.packing")
    )
    assert not bad, bad


def test_no_module_reaches_into_another_objects_private_members():
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")) or attr in FOREIGN_PRIVATE:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if isinstance(owner, ast.Name) and (owner.id in ("torch", "sys", "os") or owner.id[0].isupper()):
                continue  # other libraries' modules; a class's own private constants
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{attr}")
    assert not bad, "private members used from outside their object:\n" + "\n".join(bad)


def test_no_import_time_patching_of_sys_modules():
    for name, path in MODULES.items():
        source = path.read_text()
        assert "sys.modules[" not in source and "spec_from_file_location" not in source, path


def test_pyproject_installs_every_package_and_maps_the_top_level_folders():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(project["packages"])
    assert {n for n in MODULES if _is_package(n)} == packages
    assert project["package-dir"] == {name: folder for folder, name in MAPPED.items()}


@pytest.mark.parametrize("name", sorted(MAPPED.values()))
def test_the_mapped_folders_import_from_the_installed_package(name):
    module = importlib.import_module(name)
    folder = [f for f, n in MAPPED.items() if n == name][0]
    assert Path(module.__file__).resolve().parent == (ROOT / folder).resolve()
    assert name in sys.modules
