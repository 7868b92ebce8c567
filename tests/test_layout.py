"""The package's layout by process role holds: only the engine side imports vLLM,
and neither the export side nor the tools import the engine side; the shared
modules at the top import none of the three (the plugin entry point excepted)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "src" / "vllm_journey_otel"


def imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add("." * node.level + (node.module or ""))  # relative: not allowed
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "vllm_journey_otel":
                found.update(f"vllm_journey_otel.{alias.name}" for alias in node.names)
    return found


def modules(role: str) -> list[Path]:
    return sorted((PKG / role).glob("*.py")) if role else sorted(PKG.glob("*.py"))


def _is(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("role", ["export", "tools", ""])
def test_only_the_engine_side_imports_vllm_or_the_engine(role: str) -> None:
    offenders = []
    for path in modules(role):
        for module in imports(path):
            if _is(module, "vllm") or (
                _is(module, "vllm_journey_otel.engine") and path.name != "plugin.py"
            ):
                offenders.append(f"{path.relative_to(PKG)} imports {module}")
    assert offenders == []


def test_imports_are_absolute() -> None:
    """So the role checks above see every import."""
    relative = [
        f"{p.relative_to(PKG)}: {m}" for p in PKG.rglob("*.py") for m in imports(p) if m[0] == "."
    ]
    assert relative == []


def test_shared_modules_import_no_role() -> None:
    offenders = [
        f"{path.name} imports {module}"
        for path in modules("")
        if path.name != "plugin.py"
        for module in imports(path)
        for role in ("engine", "export", "tools")
        if _is(module, f"vllm_journey_otel.{role}")
    ]
    assert offenders == []


def test_every_module_says_where_it_runs() -> None:
    """Each module's docstring exists (it says which process and thread, and clock)."""
    missing = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert missing == []


def test_modules_and_functions_stay_small() -> None:
    big = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 520:
            big.append(f"{path.relative_to(PKG)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    big.append(f"{path.relative_to(PKG)}:{node.name}: {length} lines")
    assert big == []


# The shared modules that are contracts between the roles: every name, value
# and record format in one place, whichever role reads each part of it.
CONTRACTS = {"config", "schema", "journey", "wire", "clock", "rng", "log", "switch", "plugin"}


def _users(module: str, name: str) -> set[str]:
    """The roles (engine, export, tools; a shared module by its own name) that import ``name``."""
    found = set()
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        role = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == f"vllm_journey_otel.{module}"
                and any(alias.name == name for alias in node.names)
            ):
                found.add(role)
    return found


def test_a_shared_module_holds_only_what_several_roles_use() -> None:
    """Code that one role runs lives in that role's package (a shared module
    besides the contracts is for what more than one role calls)."""
    single = []
    for path in modules(""):
        if path.stem in CONTRACTS or path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                users = _users(path.stem, node.name)
                if len(users) < 2:
                    single.append(f"{path.name}: {node.name} used by {sorted(users)}")
    assert single == []


ROOT = PKG.parent.parent
# Files of other projects our comments name (vLLM's own module).
EXTERNAL_FILES = {"envs.py"}
_FILE_NAME = re.compile(r"(?<![\w/.-])([A-Za-z_]\w*\.py)\b")
_OUR_MODULE = re.compile(r"\bvllm_journey_otel((?:\.[a-z_]\w*)+)")


def _texts() -> list[Path]:
    parts = ("src", "tests", "benchmarks", "docs", "scripts", "deploy", "examples")
    found = [ROOT / "README.md"]
    for part in parts:
        found += [
            p
            for p in (ROOT / part).rglob("*")
            if p.suffix in (".py", ".md", ".sh", ".yaml", ".yml", ".lua")
        ]
    return found


def _resolves(dotted: str) -> bool:
    path = PKG
    for name in dotted.split("."):
        if name.startswith("__"):  # a module's own attribute (__file__, __version__)
            return True
        if not (path / name).is_dir():
            # A module (what follows names something in it), or nothing.
            return (path / f"{name}.py").is_file()
        path = path / name
    return True


def test_every_file_and_module_a_comment_or_doc_names_exists() -> None:
    """A comment, docstring or page that names a file or one of our modules
    names one that exists (not one since moved or deleted)."""
    ours = [p for p in ROOT.rglob("*.py") if not {".venv", ".cache"} & set(p.parts)]
    names = {p.name for p in ours}
    stale = []
    for path in _texts():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in _FILE_NAME.finditer(line):
                if m.group(1) not in names | EXTERNAL_FILES:
                    stale.append(f"{path.relative_to(ROOT)}:{n}: {m.group(1)}")
            for m in _OUR_MODULE.finditer(line):
                if not _resolves(m.group(1)[1:]):
                    stale.append(f"{path.relative_to(ROOT)}:{n}: vllm_journey_otel{m.group(1)}")
    assert stale == []


def test_no_module_re_exports_what_it_imports() -> None:
    """Tests and benchmarks import a name from the module that defines it, so
    each module's surface is what it runs (no ``__all__`` of imported names)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {
            n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)
        } | {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}  # fmt: skip
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = {
                    e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)
                }
                offenders += [f"{path.relative_to(PKG)}: {n}" for n in sorted(listed - defined)]
    assert offenders == []


# Where environment variables are named: config.py (every one the plugin reads)
# and switch.py (the on/off switch, read before anything else is imported).
_VARIABLE_PREFIXES = ("OTEL_", "VLLM_JOURNEY_OTEL", "REQUESTS_CA", "CURL_CA", "GRPC_")


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module's code, docstrings left out."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_only_the_config_module_names_environment_variables() -> None:
    """One config module: a variable's name is written once, where it is parsed."""
    named = [
        f"{path.relative_to(PKG)}:{node.lineno}: {node.value[:50]}"
        for path in PKG.rglob("*.py")
        if path.name not in ("config.py", "switch.py")
        for node in _strings(ast.parse(path.read_text()))
        if node.value.startswith(_VARIABLE_PREFIXES)
    ]
    assert named == []
