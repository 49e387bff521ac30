"""Triton kernels for the GPU path. Each has a torch reference in `kvgate.engine.layers` that it is
tested against (on CPU under TRITON_INTERPRET=1). Every module here imports triton; the layers
import them only for CUDA tensors, so the CPU path never needs triton."""
