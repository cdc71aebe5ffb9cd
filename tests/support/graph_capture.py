"""Capturing a training step in a CUDA graph, as the tests that replay one do (and as README's
"Capturing a step" shows): three warm-up steps on a side stream (Triton compiles, autotuning, the
allocator), then the capture on the current stream."""

from __future__ import annotations

import torch


def capture_step(step, reset):
    """``(graph, out)``: ``torch.cuda.graph`` of ``step()`` after three warm-up calls on a side stream,
    ``reset()`` (zero the gradients) before each call and before the capture. The graph writes ``out``
    and the gradients on every replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
