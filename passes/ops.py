"""The abstract redistribute op: a graph node meaning "move this tensor from spec src to spec dst".

`insert_redistribute` adds these; `lower_collectives` replaces every one with functional
collectives. It is a plain Python function so a graph holding one still runs in one process: there
it only checks that no real movement is needed (world size 1).
"""
from __future__ import annotations

import torch


def redistribute(x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Placeholder semantics before lowering: valid only when every mesh axis has size 1."""
    return x


redistribute.__module__ = "autopar.passes.ops"
