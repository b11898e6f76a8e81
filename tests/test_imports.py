"""Import hygiene and the public surface (#16 item 5), checked by parsing every module under tenplex/.

* No module imports another tenplex module's underscore names (``from .x import _y``, ``x._y`` on an
  imported module), a package ``__init__`` re-exporting them included: what modules share is public.
* Package-internal imports sit at module top; one inside a function says why on its line or the line
  before (``# lazy: <why>``: start-up time, an import cycle, an optional dependency such as FUSE).
* Every public exception class lives in tenplex/errors.py under ``TenplexError``; validation raises
  those classes, not bare ``ValueError``.
* ``tenplex.__all__`` is the documented surface.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import tenplex
import tenplex.errors

PKG = Path(tenplex.__file__).parent
ROOT = PKG.parent
LAZY_REASON = re.compile(r"#\s*lazy\b")

# Known violations in files other helpers of issue #16 are fixing concurrently (checkpoint, bubbles,
# store, elastic, train). Entries are permitted, not required: the merge of those branches empties
# these lists; delete each entry once its file is clean. Keyed by file (relative to the repository).
#: "<module>.<name>": underscore names a file may still import from another tenplex module.
ALLOWED_PRIVATE_IMPORTS: dict[str, set[str]] = {}
#: Modules a file may still import inside functions without a ``# lazy:`` reason.
ALLOWED_UNEXPLAINED_LAZY: dict[str, set[str]] = {}
#: Files that may still raise bare ``ValueError`` (instead of a TenplexError subclass).
ALLOWED_BARE_VALUE_ERRORS: set[str] = set()


def _modules() -> list[Path]:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 30
    return files


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if node.level == 0:
        return node.module or ""
    pkg = _module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _functions_around(tree: ast.AST) -> dict[ast.AST, bool]:
    """Node -> whether it sits inside a function body."""
    inside: dict[ast.AST, bool] = {}

    def visit(node: ast.AST, in_func: bool) -> None:
        inside[node] = in_func
        nested = in_func or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    visit(tree, False)
    return inside


def _scan(path: Path, source: str | None = None) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(private imports as (line, "module.name"), unexplained function-level imports as (line, module))
    of the module at ``path`` (its text, or ``source`` as if it were there)."""
    source = path.read_text() if source is None else source
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    inside = _functions_around(tree)
    private: list[tuple[int, str]] = []
    lazy: list[tuple[int, str]] = []
    module_names: dict[str, str] = {}  # local name -> the tenplex module it is bound to

    def explained(node: ast.stmt) -> bool:
        return any(LAZY_REASON.search(lines[i]) for i in (node.lineno - 1, node.lineno - 2) if i >= 0)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            if mod.split(".")[0] != "tenplex":
                continue
            for a in node.names:
                if _private(a.name):
                    private.append((node.lineno, f"{mod}.{a.name}"))
                if _is_module(f"{mod}.{a.name}"):
                    module_names[a.asname or a.name] = f"{mod}.{a.name}"
            if inside[node] and not explained(node):
                lazy.append((node.lineno, mod))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "tenplex":
                    continue
                module_names[a.asname or a.name.split(".")[0]] = a.name if a.asname else "tenplex"
                if inside[node] and not explained(node):
                    lazy.append((node.lineno, a.name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in module_names and module_names[node.value.id] != _module_name(path)):
            private.append((node.lineno, f"{module_names[node.value.id]}.{node.attr}"))
    return private, lazy


def test_no_module_imports_another_modules_underscore_names() -> None:
    bad = []
    for path in _modules():
        allowed = ALLOWED_PRIVATE_IMPORTS.get(_rel(path), set())
        bad += [f"{_rel(path)}:{line} uses {name}" for line, name in _scan(path)[0] if name not in allowed]
    assert not bad, "make these names public (or keep them inside their module):\n" + "\n".join(bad)


def test_function_level_imports_say_why_they_are_lazy() -> None:
    bad = []
    for path in _modules():
        allowed = ALLOWED_UNEXPLAINED_LAZY.get(_rel(path), set())
        bad += [f"{_rel(path)}:{line} imports {mod} inside a function" for line, mod in _scan(path)[1]
                if mod not in allowed]
    assert not bad, ("move these imports to the module top, or say why they are lazy with a '# lazy: <why>' "
                     "comment on the import's line or the line before:\n" + "\n".join(bad))


def test_the_scanner_sees_violations() -> None:
    """The checks above find what they look for (a scanner that finds nothing passes vacuously)."""
    src = ("from ..checkpoint import _fs\nfrom . import fuse\n\n\ndef f():\n    from .tree import VfsError\n"
           "    # lazy: FUSE is optional\n    from .fuse import mount\n    return fuse._x\n")
    private, lazy = _scan(PKG / "vfs" / "probe.py", src)  # as if in tenplex/vfs/, so relative imports resolve
    assert [n for _, n in private] == ["tenplex.checkpoint._fs", "tenplex.vfs.fuse._x"]
    assert lazy == [(6, "tenplex.vfs.tree")]


def test_every_public_exception_lives_in_errors_py() -> None:
    """Exception classes defined outside errors.py are private control flow (``_Refused``); public
    ones are defined in errors.py, listed in its ``__all__`` and derive from TenplexError."""
    bad = []
    for path in _modules():
        if path.name == "errors.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ClassDef) and not _private(node.name)
                    and re.search(r"(Error|Exception|Warning)$", node.name)):
                bad.append(f"{_rel(path)}:{node.lineno} defines {node.name}")
    assert not bad, "define public exceptions in tenplex/errors.py (re-export them where needed):\n" + "\n".join(bad)
    defined = {n for n, c in vars(tenplex.errors).items() if inspect.isclass(c) and issubclass(c, BaseException)
               and c.__module__ == "tenplex.errors"}
    assert defined == set(tenplex.errors.__all__)
    assert all(issubclass(getattr(tenplex.errors, n), tenplex.errors.TenplexError) for n in defined)


@pytest.mark.parametrize(("module", "name"), [
    ("tenplex.data.index", "DataIndexError"), ("tenplex.data.index", "IndexNotFoundError"),
    ("tenplex.data.index", "SourceChangedError"), ("tenplex.data.index", "SourceReadError"),
    ("tenplex.data.partition", "DataStateError"), ("tenplex.vfs.tree", "VfsError"), ("tenplex.vfs", "VfsError"),
])
def test_moved_errors_are_still_importable_from_their_old_modules(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(tenplex.errors, name)


def test_source_read_error_is_a_tenplex_error_with_errno_eio() -> None:
    e = tenplex.errors.SourceReadError("sample 3: source shrank")
    assert isinstance(e, tenplex.errors.TenplexError) and isinstance(e, OSError) and e.errno == 5


def test_validation_raises_tenplex_errors_not_bare_value_error() -> None:
    bad = []
    for path in _modules():
        if _rel(path) in ALLOWED_BARE_VALUE_ERRORS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "ValueError":
                    bad.append(f"{_rel(path)}:{node.lineno}")
    assert not bad, ("raise a TenplexError subclass from tenplex/errors.py (they are ValueErrors too) with the "
                     "failing values in the message:\n" + "\n".join(bad))


def test_spec_errors_are_value_errors() -> None:
    from tenplex.layout.ptc import Split

    with pytest.raises(tenplex.SpecError, match="Split.dim must be >= 0, got -1"):
        Split(dim=-1)
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        tenplex.model_ptc("nope")


def test_public_surface() -> None:
    """``__all__`` is the whole surface: 25 names plus the four imports/exports of other formats and the
    elastic runtime (#31 item 1), and no re-exports for earlier versions (#30 item 5): everything else is
    imported from its module."""
    assert len(tenplex.__all__) == len(set(tenplex.__all__)) <= 30
    for name in tenplex.__all__:
        assert getattr(tenplex, name) is not None, name
    for name in ("Move", "read_manifest", "Topology", "Coords", "PRESETS", "ModelSpec", "LoadResult"):
        assert not hasattr(tenplex, name), name
    assert set(tenplex._LAZY) <= set(tenplex.__all__)  # noqa: SLF001 - the table under test


def test_tier_is_the_recovery_tier() -> None:
    """``rescale(tiers=...)`` takes these: the surface's Tier is the store's."""
    import tenplex.store.recovery as recovery

    assert tenplex.Tier is recovery.Tier


def test_import_tenplex_loads_only_the_checkpoint_path() -> None:
    """``import tenplex`` in a fresh interpreter loads what ``save_state_dict`` / ``load_state_dict``
    need and nothing of rescaling, the store, scheduling, interop or networkx (#29 item 3: 0.3-1 s
    of every restarted job's start on a loaded host, where DCP's own import costs 0.3 s)."""
    import subprocess
    import sys

    code = ("import sys, tenplex; import tenplex.native.state_dict; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('tenplex', 'networkx')))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=ROOT, timeout=120).stdout.split()
    assert "tenplex.native.state_dict" in out and "tenplex.checkpoint.load" in out
    heavy = [m for m in out if m.split(".")[0] == "networkx" or m.split(".")[1:2] and m.split(".")[1] in
             ("elastic", "store", "schedule", "auto_import", "dcp_import", "hf_import", "hf_export",
              "hf_mapping", "import_source", "topology", "layouts", "memory", "reshard",
              "migrate", "membership", "data")]  # models: the manifest's model description (3 ms), compared on load
    assert heavy == [], heavy


def test_lazy_names_are_their_modules() -> None:
    """Every name ``tenplex`` imports on first use is the object its module defines."""
    for name, module in tenplex._LAZY.items():  # noqa: SLF001 - the table under test
        assert getattr(tenplex, name) is getattr(importlib.import_module(f"tenplex.{module}"), name), name
    assert set(tenplex._LAZY) <= set(dir(tenplex))  # noqa: SLF001


# The tiers, lowest first (#30 item 1): a module imports only from its own tier or a lower one, type-only
# (``if TYPE_CHECKING:``) and function-level imports included. Tiers on one line are peers (neither
# imports the other). Derived from the import map after the move: data/ (sample partitions) sits below
# planning/ because layout choice counts samples per replica; checkpoint/ below native/ because a
# state-dict load is a checkpoint load; store/ and vfs/ serve checkpoints to elastic/ and train/.
TIERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("options", "urls"),  # root utilities (option objects, url_fs) the tiers above share, once merged
    ("layout",),
    ("data",),
    ("planning",),
    ("checkpoint",),
    ("native",),
    ("store", "vfs"),
    ("elastic",),
    ("train",),
    ("cli",),
    ("tenplex", "__main__"),  # the package surface (lazy names of every tier) and ``python -m tenplex``
)
LEVEL = {tier: level for level, tiers in enumerate(TIERS) for tier in tiers}
#: Import cycles (sets of modules, type-only arrows included) other helpers are removing concurrently:
#: permitted, not required; delete an entry once its cycle is gone.
ALLOWED_CYCLES: list[set[str]] = []


def _tier(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tenplex"


def _import_map(sources: dict[Path, str]) -> dict[str, dict[str, list[str]]]:
    """module -> {imported tenplex module -> ["file:line", ...]} over every import statement (module top,
    ``TYPE_CHECKING`` blocks, function bodies); ``from m import x`` is an arrow to ``m.x`` when that is
    a module, else to ``m``."""
    modules = {_module_name(p) for p in sources}
    arrows: dict[str, dict[str, list[str]]] = {}
    for path, source in sources.items():
        here = _module_name(path)
        out = arrows.setdefault(here, {})
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != here:
                    out.setdefault(t, []).append(f"{_rel(path)}:{node.lineno}")
    return arrows


def _upward_arrows(arrows: dict[str, dict[str, list[str]]]) -> list[str]:
    bad = []
    for src, targets in sorted(arrows.items()):
        for dst, where in sorted(targets.items()):
            a, b = _tier(src), _tier(dst)
            if a not in LEVEL or b not in LEVEL:
                bad.append(f"{where[0]}: {src} -> {dst}: tier {a if a not in LEVEL else b!r} is not in TIERS")
            elif a != b and LEVEL[b] >= LEVEL[a]:
                bad.append(f"{where[0]}: {src} ({a}) -> {dst} ({b}): imports upward or sideways")
    return bad


def _cycles(arrows: dict[str, dict[str, list[str]]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(arrows.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def _describe(component: set[str], arrows: dict[str, dict[str, list[str]]]) -> str:
    return "; ".join(f"{arrows[a][b][0]}: {a} -> {b}" for a in sorted(component)
                     for b in sorted(arrows.get(a, {})) if b in component)


def test_imports_run_down_the_tiers() -> None:
    """Every arrow of the import map points to the module's own tier or a lower one (type-only included)."""
    arrows = _import_map({p: p.read_text() for p in _modules()})
    assert _upward_arrows(arrows) == []


def test_the_import_map_has_no_cycle() -> None:
    """No import cycle between modules, type-only and function-level arrows included."""
    arrows = _import_map({p: p.read_text() for p in _modules()})
    cycles = [c for c in _cycles(arrows) if c not in ALLOWED_CYCLES]
    assert [_describe(c, arrows) for c in cycles] == []


def test_the_tier_check_sees_violations() -> None:
    """An upward type-only arrow and a two-module cycle, as sources placed under tenplex/."""
    sources = {
        PKG / "layout" / "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..elastic import x\n"
                                 "from . import b\n",
        PKG / "layout" / "b.py": "def f():\n    from .a import y  # lazy: test\n",
        PKG / "elastic" / "__init__.py": "x = 1\n",
    }
    arrows = _import_map(sources)
    assert _upward_arrows(arrows) == [
        "tenplex/layout/a.py:3: tenplex.layout.a (layout) -> tenplex.elastic (elastic): imports upward or sideways"]
    assert _cycles(arrows) == [{"tenplex.layout.a", "tenplex.layout.b"}]
