"""The dependency rules of the packages, checked on their source (an AST walk; nothing is
imported), so a forbidden import fails here before it fails a user:

- the roles (``cloud``, ``edge_node``, ``device_agent``) import ``shared`` and never each
  other (``estuary`` is the composition root that may import them all);
- ``shared`` imports no role and not ``estuary``;
- ``shared``'s subpackages form floors, each importing only its own floor and the ones
  below (:data:`FLOORS`), so there is no import cycle inside ``shared``, not even behind a
  function-local import;
- what a sampling-only device runs (the wire format, the transport, the ONNX sampler,
  signing, the config, the role runtime and the device's own sampling modules) imports no
  module of the training extra (torch, diffusers, ...) when it is loaded;
- only ``shared.transport`` imports paho;
- outside the methods' packages a method is known only through its interface and the
  registry: no module imports another part of ``shared.methods``, none compares
  ``algorithm.name`` with a name, and each role reads at most :data:`MAX_MEMBERS` members of
  the method interface.

Each rule is a function over a source tree that returns its violations; the tests run them
on this repository (no violation) and on small trees made to break each rule (the rule
must see it), so none of them can pass by seeing nothing.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "cloud", "edge_node", "device_agent", "estuary")
ROLES = ("cloud", "edge_node", "device_agent")
#: shared's floors, lowest first: a module imports only from its own floor and lower ones
FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "shared",
        "shared.errors",
        "shared.atomic",
        "shared.lifetime",
        "shared.settings",
        "shared.families",
        "shared.seeds",
    ),
    ("shared.config", "shared.methods.registry"),
    ("shared.wire",),
    ("shared.transport",),
    ("shared.models", "shared.naming", "shared.federation"),
    ("shared.data",),
    ("shared.diffusion",),
    ("shared.evaluation",),
    ("shared.methods",),
    ("shared.metrics",),
    ("shared.runtime",),
    ("shared.deploy",),
)
#: modules of the "train" extra, which a sampling-only install lacks
TRAIN_MODULES = frozenset(
    {"torch", "diffusers", "torch_pruning", "safetensors", "scipy", "matplotlib", "onnx"}
)
#: what a sampling-only device loads (``estuary device --sample-only``, ``estuary sample``)
TORCH_FREE = (
    "shared.wire",
    "shared.transport",
    "shared.deploy.onnx_sampler",
    "shared.deploy.onnx_classifier",
    "shared.deploy.signing",
    "shared.config",
    "shared.naming",
    "shared.runtime.process",
    "shared.runtime.service",
    "shared.runtime.cpu",
    "device_agent.main",
    "device_agent.deployment",
    "device_agent.sampling",
)


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written (a module, or a name in one)."""

    source: str  # the importing module
    target: str  # dotted module the statement names (``from a.b import c``: ``a.b.c`` if
    # that is a module, else ``a.b``)
    line: int
    deferred: bool  # inside a function: runs when called, not when the module loads


def modules(root: Path) -> dict[str, Path]:
    """Every module of :data:`PACKAGES` under ``root``, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """The imports of module ``name`` that run (``if TYPE_CHECKING:`` blocks excluded)."""
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST, deferred: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from walk(sub, deferred)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(name, alias.name, child.lineno, deferred)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (child.level - 1)]
                    base = ".".join([*package, *([base] if base else [])])
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in known else base
                    yield Import(name, target, child.lineno, deferred)
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, deferred or inner)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), False)


def _first_party(target: str) -> bool:
    return target.split(".")[0] in PACKAGES


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@functools.cache
def all_imports(root: Path) -> tuple[Import, ...]:
    """Every import of every module under ``root`` (read once per tree)."""
    known = modules(root)
    return tuple(imp for name, path in known.items() for imp in imports(name, path, known))


# -- the rules ---------------------------------------------------------------------------


def role_violations(root: Path) -> list[str]:
    """Roles import ``shared`` (and themselves) only; ``shared`` imports no role or CLI."""
    out = []
    for imp in all_imports(root):
        if not _first_party(imp.target):
            continue
        src, dst = imp.source.split(".")[0], imp.target.split(".")[0]
        if src in ROLES and dst not in ("shared", src):
            out.append(f"{imp.source}:{imp.line} (a role) imports {imp.target}")
        if src == "shared" and dst != "shared":
            out.append(f"{imp.source}:{imp.line} (the library) imports {imp.target}")
    return out


#: each method's settings (``shared.methods.<name>.config``) sit on the config floor with the
#: registry: every process reads them, torch-free, to parse a run config
SETTINGS_MODULE = re.compile(r"^shared\.methods\.\w+\.config$")


def floor_of(module: str) -> int | None:
    """The floor of a ``shared`` module (the longest matching prefix; a method's settings:
    the config floor), None outside it."""
    if SETTINGS_MODULE.match(module):
        module = "shared.config"
    best: tuple[int, int] | None = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if _within(module, prefix) and (best is None or len(prefix) > best[1]):
                best = (level, len(prefix))
    return None if best is None else best[0]


def floor_violations(root: Path) -> list[str]:
    """Imports inside ``shared`` that reach a higher floor (deferred ones included)."""
    out = []
    for imp in all_imports(root):
        if not (_within(imp.source, "shared") and _within(imp.target, "shared")):
            continue
        src, dst = floor_of(imp.source), floor_of(imp.target)
        if src is None or dst is None:
            out.append(f"{imp.source}:{imp.line}: {imp.target} has no floor in FLOORS")
        elif dst > src:
            out.append(
                f"{imp.source}:{imp.line} (floor {FLOORS[src][0]}) imports {imp.target} "
                f"(floor {FLOORS[dst][0]}, higher)"
            )
    return out


def cycles(root: Path) -> list[list[str]]:
    """Import cycles among ``shared``'s modules (deferred imports count: a function-local
    import that only dodges a cycle is still a cycle)."""
    graph: dict[str, set[str]] = {}
    for imp in all_imports(root):
        if _within(imp.source, "shared") and _within(imp.target, "shared"):
            if imp.source != imp.target:
                graph.setdefault(imp.source, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def loaded_with(root: Path, module: str) -> dict[str, str]:
    """Third-party top-level packages that loading ``module`` imports (its package
    ``__init__`` files and every first-party module reached by imports that run at load
    time), each with the first-party module that imports it."""
    known = modules(root)
    by_source: dict[str, list[Import]] = {}
    for imp in all_imports(root):
        by_source.setdefault(imp.source, []).append(imp)
    todo = [module]
    parts = module.split(".")
    todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages' __init__s
    seen: set[str] = set()
    third: dict[str, str] = {}
    while todo:
        name = todo.pop()
        if name in seen or name not in known:
            continue
        seen.add(name)
        for imp in by_source.get(name, ()):
            if imp.deferred:
                continue
            if _first_party(imp.target):
                target_parts = imp.target.split(".")
                todo += [".".join(target_parts[:i]) for i in range(1, len(target_parts) + 1)]
            else:
                third.setdefault(imp.target.split(".")[0], f"{name}:{imp.line}")
    return third


def torch_free_violations(root: Path) -> list[str]:
    """Modules of the training extra that the sampling-only path loads."""
    known = modules(root)
    out = []
    for prefix in TORCH_FREE:
        for name in sorted(m for m in known if _within(m, prefix)):
            for package, where in sorted(loaded_with(root, name).items()):
                if package in TRAIN_MODULES:
                    out.append(f"loading {name} imports {package} ({where})")
    return out


def paho_violations(root: Path) -> list[str]:
    """paho imported outside ``shared.transport``."""
    return [
        f"{imp.source}:{imp.line} imports {imp.target}"
        for imp in all_imports(root)
        if imp.target.split(".")[0] == "paho" and not _within(imp.source, "shared.transport")
    ]


#: what the rest of the code may import of ``shared.methods``
METHOD_INTERFACE = ("shared.methods", "shared.methods.api", "shared.methods.registry")
#: the most members of the method interface one role reads
MAX_MEMBERS = 6


def interface_violations(root: Path) -> list[str]:
    """Imports of a method's package (or any part of ``shared.methods`` other than the
    interface and the registry) from outside ``shared.methods``."""
    return [
        f"{imp.source}:{imp.line} imports {imp.target}"
        for imp in all_imports(root)
        if _within(imp.target, "shared.methods")
        and imp.target not in METHOD_INTERFACE
        and not _within(imp.source, "shared.methods")
    ]


#: ``algorithm.name`` compared with a method's name
NAME_CHECK = re.compile(r"algorithm\.name ?(==|!=| in )")


def name_check_violations(root: Path) -> list[str]:
    """Lines outside the methods' packages that ask which method runs."""
    out = []
    for name, path in modules(root).items():
        if _within(name, "shared.methods"):
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NAME_CHECK.search(line):
                out.append(f"{name}:{i}: {line.strip()}")
    return out


#: the objects whose ``algorithm`` is the method (a service, or a service held by a helper),
#: as opposed to the config section ``cfg.algorithm`` or a summary's figures
HOLDERS = frozenset({"self", "cloud", "edge", "agent", "device", "d"})


def _is_method(node: ast.expr) -> bool:
    """Whether ``node`` is the method object a role holds: ``algorithm`` (a parameter) or
    ``<holder>.algorithm``."""
    if isinstance(node, ast.Name):
        return node.id == "algorithm"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "algorithm"
        and isinstance(node.value, ast.Name)
        and node.value.id in HOLDERS
    )


def members_read(root: Path) -> dict[str, set[str]]:
    """The members of the method object each role reads."""
    out: dict[str, set[str]] = {role: set() for role in ROLES}
    for name, path in modules(root).items():
        role = name.split(".")[0]
        if role not in ROLES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and _is_method(node.value):
                out[role].add(node.attr)
    return out


def member_violations(root: Path) -> list[str]:
    """Roles reading more than :data:`MAX_MEMBERS` members of the method interface."""
    return [
        f"{role} reads {len(found)} members of the method: {sorted(found)}"
        for role, found in members_read(root).items()
        if len(found) > MAX_MEMBERS
    ]


RULES = {
    "interface": interface_violations,
    "names": name_check_violations,
    "members": member_violations,
    "roles": role_violations,
    "floors": floor_violations,
    "cycles": lambda root: [" -> ".join(c) for c in cycles(root)],
    "torch-free": torch_free_violations,
    "paho": paho_violations,
}


# -- this repository ---------------------------------------------------------------------


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_repository_keeps_the_rule(rule: str) -> None:
    assert RULES[rule](ROOT) == []


def test_each_role_reads_few_members_of_the_method() -> None:
    read = members_read(ROOT)
    assert all(0 < len(found) <= MAX_MEMBERS for found in read.values()), read


def test_every_shared_module_has_a_floor() -> None:
    shared = [m for m in modules(ROOT) if _within(m, "shared")]
    assert len(shared) > 40
    assert [m for m in shared if floor_of(m) is None] == []


def test_every_subpackage_says_what_belongs_there() -> None:
    """Each subpackage of ``shared`` opens with a docstring of its own."""
    for init in sorted((ROOT / "shared").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 20, f"{init} says too little about its subpackage"


# -- each rule sees a violation --------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A minimal source tree: every package of :data:`PACKAGES` plus ``files``."""
    for package in PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(tmp_path).parents:
            if str(parent) != "." and not (tmp_path / parent / "__init__.py").exists():
                (tmp_path / parent / "__init__.py").write_text("")
        path.write_text(text)
    return tmp_path


BROKEN = {
    "roles": ({"cloud/main.py": "from edge_node.service import EdgeServer\n"}, "cloud.main:1"),
    "floors": (
        {
            "shared/wire/codec.py": "def f():\n    from shared.models.presets import x\n",
            "shared/models/presets.py": "x = 1\n",
        },
        "shared.wire.codec:2",
    ),
    "cycles": (
        {
            "shared/models/a.py": "from shared.models import b\n",
            "shared/models/b.py": "def f():\n    from shared.models.a import g\n",
        },
        "shared.models.a -> shared.models.b",
    ),
    "torch-free": (
        {
            "shared/deploy/signing.py": "from shared.models.presets import x\n",
            "shared/models/presets.py": "import torch\nx = 1\n",
        },
        "loading shared.deploy.signing imports torch",
    ),
    "paho": ({"edge_node/service.py": "import paho.mqtt.client as mqtt\n"}, "edge_node.service:1"),
    "interface": (
        {
            "shared/methods/prism/method.py": "x = 1\n",
            "estuary/simulate.py": "from shared.methods.prism.method import x\n",
        },
        "estuary.simulate:1 imports shared.methods.prism.method",
    ),
    "names": (
        {"cloud/main.py": "if cfg.algorithm.name == 'prism':\n    pass\n"},
        "cloud.main:1",
    ),
    "members": (
        {"edge_node/service.py": "".join(f"self.algorithm.m{i}\n" for i in range(7))},
        "edge_node reads 7 members",
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_sees_its_violation(rule: str, tmp_path: Path) -> None:
    files, expected = BROKEN[rule]
    found = RULES[rule](_tree(tmp_path, files))
    assert any(expected in line for line in found), found
    assert RULES[rule](_tree(tmp_path / "clean", {})) == []


def test_a_role_reaching_into_the_library_layout_is_fine(tmp_path: Path) -> None:
    """Roles may import any part of ``shared``, and ``estuary`` may import the roles."""
    root = _tree(tmp_path, {
        "cloud/main.py": "from shared.models.presets import x\nimport cloud.service\n",
        "estuary/simulate.py": "from cloud import main\nfrom device_agent import service\n",
        "shared/models/presets.py": "x = 1\n",
    })  # fmt: skip
    assert role_violations(root) == []
