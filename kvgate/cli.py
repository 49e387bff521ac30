"""The `kvgate` command: one entry point, one subcommand per component or job.

Each subcommand lives in its own module exposing `HELP`, `configure_parser(parser)` and
`run(args) -> int`. Those modules keep heavy imports (torch, grpc, kopf) inside `run`, so
`kvgate --help` stays instant.

A component image installs only its own folder (docker/*.Dockerfile), so a command whose
module is absent is listed as not installed rather than failing at import.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# (command path) -> module implementing it
COMMANDS: dict[tuple[str, ...], str] = {
    ("engine", "serve"): "kvgate.engine.cli",
    ("engine", "fetch-adapters"): "kvgate.engine.lora_fetch",
    ("epp", "serve"): "kvgate.epp.cli",
    ("router", "serve"): "kvgate.gateway.router_cli",
    ("gateway", "extension-server"): "kvgate.gateway.extension_cli",
    ("operator", "run"): "kvgate.operator.cli",
    ("up",): "kvgate.local.cli",
    ("bench",): "kvgate.bench.cli",
    ("batch", "serve"): "kvgate.batch.cli",
    ("batch", "status"): "kvgate.batch.status_cli",
}

GROUP_HELP = {
    "engine": "the model server (OpenAI-compatible API, vLLM metrics, KV events)",
    "epp": "the endpoint picker (Envoy ext-proc, GIE protocol)",
    "router": "the model router: one gateway for several pools, chosen by the body's model",
    "gateway": "InferencePool support for a Gateway API implementation (Envoy Gateway)",
    "operator": "the Kubernetes operator (ModelDeployment, InferencePool)",
    "batch": "the OpenAI Batch API (files, batches) in front of the gateway",
}

EXIT_USAGE = 2
NOT_INSTALLED = "not installed here (this image or install lacks that component)"


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None
        raise


def _selected(argv: list[str] | None) -> tuple[str, ...] | None:
    """The command path argv names, if any: then only that command's module is imported."""
    args = sys.argv[1:] if argv is None else argv
    for path in COMMANDS:
        if tuple(args[: len(path)]) == path:
            return path
    return None


def build_parser(argv: list[str] | None = None, *, only_selected: bool = False) -> argparse.ArgumentParser:
    """The full parser; with only_selected, other commands' modules are not imported (they may
    be slow to import, and every engine start-up would pay for them)."""
    selected = _selected(argv) if only_selected else None
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="kvgate: Kubernetes-native LLM serving. Run `kvgate up` for a local stack.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module_name in COMMANDS.items():
        skip = selected is not None and path != selected
        module = None if skip else _load(module_name)
        help_text = getattr(module, "HELP", NOT_INSTALLED)
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text, description=help_text)
        else:
            group, leaf = path
            if group not in groups:
                gp = sub.add_parser(group, help=GROUP_HELP[group], description=GROUP_HELP[group])
                groups[group] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            p = groups[group].add_parser(leaf, help=help_text, description=help_text)
        p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
        if module is not None:
            module.configure_parser(p)
        p.set_defaults(_module=module_name, _path=path)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv, only_selected=True)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return EXIT_USAGE
    module = _load(args._module)
    if module is None:
        print(f"kvgate {' '.join(args._path)}: {NOT_INSTALLED}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
