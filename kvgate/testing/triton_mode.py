"""How the Triton kernel tests run: interpreted on CPU (the default, and all CI has) or compiled
on a CUDA GPU.

`KVGATE_TRITON_DEVICE=cuda` (scripts/gpu_check.sh sets it on a GPU machine) runs the same tests
through Triton's compiler on CUDA tensors instead of its interpreter on CPU ones. Compiled fp32
`tl.dot` would use TF32 by default; `TRITON_F32_DEFAULT=ieee` keeps it full fp32 so the
interpreter's tolerances still hold and a wrong kernel is not hidden behind a looser bound.

Triton decides interpret-or-compile when a kernel is decorated, i.e. when its module is imported,
so `configure()` runs before the kernel modules are imported, and `kernel_module()` reloads a
module that something imported earlier in the other mode.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV = "KVGATE_TRITON_DEVICE"


def compiled() -> bool:
    """True when the kernel tests should run compiled on CUDA rather than interpreted on CPU."""
    return os.environ.get(ENV, "cpu") == "cuda"


def configure() -> bool:
    """Sets Triton's variables for the chosen mode; returns `compiled()`."""
    if compiled():
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def configure_test_module() -> bool:
    """A kernel test module's preamble: configure(), then skip the whole module where its mode
    cannot run (compiled without a CUDA GPU; Triton or numpy missing). Returns `compiled()`."""
    import pytest
    import torch

    mode_compiled = configure()
    if mode_compiled and not torch.cuda.is_available():
        pytest.skip(f"{ENV}=cuda needs a CUDA GPU", allow_module_level=True)
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    return mode_compiled


def is_interpreted(kernel: object) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def kernel_module(name: str) -> ModuleType:
    """Imports a kernel module, reloading it if its kernels were decorated in the other mode."""
    module = importlib.import_module(name)
    kernels = [v for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")]
    if any(is_interpreted(k) == compiled() for k in kernels):
        module = importlib.reload(module)
    return module
