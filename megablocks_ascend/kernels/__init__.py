"""Triton kernels. Written once; launched on NPU (triton-ascend), CUDA (Triton) and CPU (interpreter)."""
