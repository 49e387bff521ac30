"""Every third-party module a component image can import comes from a distribution that image
installs: its extra in pyproject.toml or the base dependencies.

The development venv installs every extra, so a module that only another component's extra
declares imports fine in `make test` and crashes the image at start (the engine imported httpx,
declared only by the EPP's extra). This reads the code, as the import-floor test does, instead of
building images: it follows kvgate's own imports from each image's entry points over the files
the image copies (docker/*.Dockerfile: kvgate/ less kvgate/testing, api/, the component's
folders: the EPP image's are epp/ and gateway/), collects the third-party modules, and maps each to the distribution that provides it in
this venv. A distribution must be declared directly (one that only arrives as another's
dependency can vanish with that dependency's next release).

Imports inside functions count (they run later, and fail later). Imports under
``if TYPE_CHECKING:`` do not run and do not count. An import guarded by ``except ImportError``
whose distribution the extra does not declare must be listed in ``OPTIONAL`` with the message
the user then gets; a guarded import of a declared distribution is fine.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# kvgate.<x> -> repo folder, as setup.py maps them
PACKAGE_ROOTS = {
    "kvgate.api": ROOT / "api",
    "kvgate.engine": ROOT / "engine",
    "kvgate.epp": ROOT / "epp",
    "kvgate.gateway": ROOT / "gateway",
    "kvgate.operator": ROOT / "operator",
    "kvgate": ROOT / "kvgate",
}

# Image (and the extra it installs, docker/<name>.Dockerfile) -> the component folders it copies
# besides kvgate/ and api/. Every module of those folders is a root: each must import in the image.
# The gateway (model router, Envoy bootstrap) runs on the EPP's ext_proc plumbing: the EPP image.
IMAGES = {"engine": ("engine",), "epp": ("epp", "gateway"), "operator": ("operator",)}
# Modules of kvgate/ (the CLI package) are followed through their module-level imports only: the
# image runs `kvgate --help`, which imports every command module (kvgate.local.cli,
# kvgate.bench.cli too), but runs only its own component's commands.
CLI_ROOTS = ("kvgate.cli", "kvgate.__main__")
NOT_IN_IMAGES = ("kvgate.testing",)

# (image, distribution) -> words of the error the user gets instead (found in the importing file).
OPTIONAL: dict[tuple[str, str], str] = {
    # api/tokenizer.py converts a GGUF file or a folder without tokenizer.json once, with
    # transformers; the EPP is given a Hub id or a folder with tokenizer.json (the operator
    # names none for a GGUF model), and otherwise says to install both or to name such a folder.
    ("epp", "transformers"): "needs `transformers`",
    ("epp", "gguf"): "and `gguf`",
}


def _dist_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return _dist_key(match.group(1))


def declared(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [*project["dependencies"], *project["optional-dependencies"][extra]]
    return {_requirement_name(r) for r in names}


def module_file(module: str) -> Path | None:
    """The source file of a kvgate module, or None if it is not one (an attribute import)."""
    for prefix, folder in PACKAGE_ROOTS.items():
        if module == prefix or module.startswith(prefix + "."):
            rel = module[len(prefix) :].lstrip(".").split(".") if module != prefix else []
            base = folder.joinpath(*rel)
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if rel and candidate.is_file():
                    return candidate
            if not rel and (folder / "__init__.py").is_file():
                return folder / "__init__.py"
            return None
    return None


@dataclass
class ThirdParty:
    third_party: dict[str, bool] = field(default_factory=dict)  # top-level name -> every import guarded
    where: dict[str, str] = field(default_factory=dict)  # top-level name -> first file:line

    def note(self, top: str, guarded: bool, where: str) -> None:
        self.third_party[top] = self.third_party.get(top, True) and guarded
        self.where.setdefault(top, where)


@dataclass
class Imports(ThirdParty):
    kvgate: set[str] = field(default_factory=set)  # kvgate modules (or module.attribute)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _guards_import_error(handler: ast.ExceptHandler) -> bool:
    names: list[ast.expr] = []
    if isinstance(handler.type, ast.Tuple):
        names = list(handler.type.elts)
    elif handler.type is not None:
        names = [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _absolute(module: str | None, level: int, path: Path) -> str | None:
    """The absolute name of a relative import in kvgate's folders."""
    if level == 0:
        return module
    for prefix, folder in PACKAGE_ROOTS.items():
        if path.is_relative_to(folder):
            parts = [*prefix.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            base = parts[: len(parts) - level + (1 if path.name == "__init__.py" else 0)]
            return ".".join([*base, module] if module else base)
    return None


def scan(path: Path, module_level_only: bool) -> Imports:
    found = Imports()
    tree = ast.parse(path.read_text(), str(path))

    def add(name: str, guarded: bool, node: ast.AST) -> None:
        if name == "kvgate" or name.startswith("kvgate."):
            found.kvgate.add(name)
            return
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            return
        found.note(top, guarded, f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}")

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, guarded)
            return
        if module_level_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Try):
            catches = any(_guards_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, guarded or catches)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, guarded, node)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, path)
            if module is not None:
                if module == "kvgate" or module.startswith("kvgate."):
                    for alias in node.names:
                        found.kvgate.add(f"{module}.{alias.name}")
                add(module, guarded, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # importlib.import_module("kvgate.x") / COMMANDS tables name modules as strings
            if re.fullmatch(r"kvgate(\.\w+)+", node.value):
                found.kvgate.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return found


@dataclass
class Closure(ThirdParty):
    files: set[Path] = field(default_factory=set)


def image_closure(image: str) -> Closure:
    folders = [ROOT / f for f in IMAGES[image]]
    in_image = [PACKAGE_ROOTS["kvgate.api"], *folders, PACKAGE_ROOTS["kvgate"]]
    roots = [*CLI_ROOTS]
    roots += [
        "kvgate." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for folder in folders
        for p in sorted(folder.rglob("*.py"))
    ]
    closure = Closure()
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or any(name == p or name.startswith(p + ".") for p in NOT_IN_IMAGES):
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            if "." in name:  # `from kvgate.x import attr`: the module is kvgate.x
                todo.append(name.rsplit(".", 1)[0])
            continue
        if not any(path.is_relative_to(d) for d in in_image):
            continue  # another component's module: the image lacks it, kvgate.cli reports that
        if path in closure.files:
            continue
        closure.files.add(path)
        # parents are imported first
        parent = name.rsplit(".", 1)[0]
        if parent != name:
            todo.append(parent)
        found = scan(path, module_level_only=path.is_relative_to(PACKAGE_ROOTS["kvgate"]))
        todo.extend(found.kvgate)
        for top, guarded in found.third_party.items():
            closure.note(top, guarded, found.where[top])
    return closure


def distributions_of(top: str) -> set[str]:
    return {_dist_key(d) for d in importlib.metadata.packages_distributions().get(top, [])}


def undeclared(image: str) -> list[str]:
    allowed = declared(image)
    problems: list[str] = []
    closure = image_closure(image)
    for top, guarded in sorted(closure.third_party.items()):
        dists = distributions_of(top)
        where = closure.where[top]
        if not dists:
            problems.append(f"{where}: imports {top!r}, which no installed distribution provides")
            continue
        if dists & allowed:
            continue
        if guarded and any((image, d) in OPTIONAL for d in dists):
            continue
        how = "guarded by except ImportError but not listed in OPTIONAL" if guarded else "imported"
        problems.append(
            f"{where}: {top!r} ({', '.join(sorted(dists))}) is {how}; the {image} extra "
            f"in pyproject.toml does not declare it, so the {image} image lacks it"
        )
    return problems


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_third_party_import_is_declared_by_the_images_extra(image: str) -> None:
    problems = undeclared(image)
    assert not problems, "\n".join(problems)


def test_optional_imports_are_guarded_and_named() -> None:
    """Each listed optional import is still made, only under a guard, and the file that makes it
    says the listed words to the user."""
    for (image, dist), message in OPTIONAL.items():
        assert dist not in declared(image), f"{dist} is declared by the {image} extra: not optional there"
        closure = image_closure(image)
        tops = [top for top in closure.third_party if dist in distributions_of(top)]
        assert tops, f"nothing in the {image} image imports {dist}: drop it from OPTIONAL"
        for top in tops:
            assert closure.third_party[top], f"{closure.where[top]}: {top} is imported unguarded"
            source = (ROOT / closure.where[top].split(":")[0]).read_text()
            assert message in source, f"{closure.where[top]} does not tell the user {message!r}"


def test_each_image_copies_the_folders_listed_here() -> None:
    """IMAGES is what the Dockerfiles copy: a component folder left out of an image's Dockerfile
    (the gateway's, say) would pass the import checks here and crash the image."""
    code = {f"{folder}/" for folder in setup_roots()}
    for image, folders in IMAGES.items():
        dockerfile = (ROOT / "docker" / f"{image}.Dockerfile").read_text()
        copied = {
            m.rstrip("/") + "/" for m in re.findall(r"^COPY\s+(\S+)\s+\./\S+\s*$", dockerfile, flags=re.M)
        }
        assert copied & code == {"kvgate/", "api/", *(f"{f}/" for f in folders)}, (image, copied)
    # every component folder ships in some image
    assert {f for fs in IMAGES.values() for f in fs} | {"kvgate", "api"} == set(setup_roots())


def setup_roots() -> list[str]:
    """The code folders setup.py installs (its ROOTS table)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets
        ):
            return list(ast.literal_eval(node.value).values())
    raise AssertionError("setup.py has no ROOTS table")


def test_the_closure_reaches_what_the_image_runs() -> None:
    """A guard that saw nothing would pass: the engine's closure must reach its server, the
    shared prompt code and the CLI, and leave out other components and kvgate.testing."""
    files = {p.relative_to(ROOT).as_posix() for p in image_closure("engine").files}
    assert {
        "engine/server/app.py",
        "engine/server/kv_transfer_http.py",
        "api/tokenizer.py",
        "kvgate/cli.py",
    } <= files
    assert not any(f.startswith(("epp/", "operator/", "kvgate/testing/")) for f in files)
    assert "starlette" in image_closure("engine").third_party
    assert "kopf" in image_closure("operator").third_party
    epp = {p.relative_to(ROOT).as_posix() for p in image_closure("epp").files}
    assert {"epp/server.py", "gateway/model_router.py", "gateway/envoy_config.py"} <= epp
    assert "envoy" in image_closure("epp").third_party  # the bootstrap builder's protos


def test_an_undeclared_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself fails on the shape of the original bug: an engine module importing a
    distribution only the EPP's extra declares."""
    folder = tmp_path / "engine"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "uses_grpc.py").write_text("def later():\n    import grpc\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    monkeypatch.setitem(PACKAGE_ROOTS, "kvgate.engine", folder)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setitem(PACKAGE_ROOTS, "kvgate.api", tmp_path / "api")
    monkeypatch.setitem(PACKAGE_ROOTS, "kvgate", tmp_path / "kvgate")
    problems = undeclared("engine")
    assert any("'grpc'" in p and "engine extra" in p for p in problems), problems
