"""Model building blocks. Each op has a torch path (CPU, and the reference the Triton kernels are
tested against) and dispatches to the Triton kernel in `kvgate.engine.kernels` on CUDA tensors."""
