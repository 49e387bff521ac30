"""Maps the component folders into the `kvgate` namespace.

`operator/` at the repo root must never be importable as `operator` (it would shadow the
stdlib), so each code folder is installed under `kvgate.<name>` instead.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "kvgate": "kvgate",
    "kvgate.api": "api",
    "kvgate.engine": "engine",
    "kvgate.epp": "epp",
    "kvgate.gateway": "gateway",
    "kvgate.operator": "operator",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder)
            packages.append(".".join([name, *rel.parts]) if rel.parts else name)
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, include_package_data=True)
