"""CUDA graphs for the rollout engine's decode-step forwards, captured per (kind, bucket, T).

Decode steps are many tiny forwards whose launch overhead dominates on a GPU; the engine keeps its
buffers at fixed addresses (compaction is in place, `engine`), so one graph per (kind, batch bucket,
tokens per row) replays every step of that shape. Every graph shares one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CudaGraphs:
    """Decode-step forwards captured per (kind, bucket, T) on CUDA; every graph shares one memory pool.

    Outputs are cloned right after replay, so graphs may replay in any order."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}

    def run(self, key: Any, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        if key not in self.graphs:
            static = [x.clone() for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up (same inputs: rewrites identical cache entries)
                fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(*static)
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        for dst, src in zip(static, inputs, strict=False):
            dst.copy_(src)
        graph.replay()
        return tuple(o.clone() if o is not None else None for o in out)

    def drop(self, kind: str) -> None:
        self.graphs = {k: v for k, v in self.graphs.items() if k[0] != kind}


__all__ = ["CudaGraphs"]
