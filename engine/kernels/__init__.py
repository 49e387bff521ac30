"""Triton kernels for the GPU path. Each has a torch reference in `kvgate.engine.layers` that it is
tested against (on CPU under TRITON_INTERPRET=1). Importing this package imports triton."""
