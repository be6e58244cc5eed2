"""torch's own test Transformer (`torch.testing._internal.distributed._tensor.common_dtensor`), unchanged.

The classes are read with `ast` from the installed torch file and executed here, instead of
importing that module: importing it imports `torch.testing._internal.common_utils`, which needs
the `expecttest` package and, at import time, parses `sys.argv`, seeds torch's RNG
(`set_rng_seed()`) and calls `torch.backends.disable_global_flags()` -- side effects that would
leak into every other test of the session. The class bodies are torch's text, less
`Transformer.parallelize` (DTensor's plans, whose annotations name DTensor types).
`Experts.forward` tests `isinstance(self.w1, DTensor)`, which a GlobalTensor is not, so
`DTensor` is bound to a class nothing is an instance of.

The experts (`Experts`, `ExpertLayer`, `ModelArgs.num_experts`) are newer than the rest: torch
2.11's file has the dense Transformer only. `HAS_EXPERTS` says whether this torch's has them, and
`requires_experts` skips a test that needs them where it has not.
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass, fields

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch.testing._internal.distributed._tensor as _package

CLASSES = ("ModelArgs", "Attention", "FeedForward", "TransformerBlock", "Transformer")
EXPERT_CLASSES = ("Experts", "ExpertLayer")  # not in torch 2.11's file
SOURCE = pathlib.Path(_package.__file__).with_name("common_dtensor.py")


class DTensor:
    """Stands in for torch's DTensor in `Experts.forward`'s isinstance test."""


def _load(source: pathlib.Path = SOURCE) -> dict:
    tree = ast.parse(source.read_text())
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in CLASSES + EXPERT_CLASSES]
    missing = set(CLASSES) - {node.name for node in found}
    if missing:
        raise ImportError(f"{source} no longer defines {sorted(missing)}")
    for node in found:  # the parallelize() staticmethod names DTensor-only types in annotations
        node.body = [b for b in node.body if not (isinstance(b, ast.FunctionDef) and b.name == "parallelize")]
    namespace = {"torch": torch, "nn": nn, "F": F, "dataclass": dataclass, "DTensor": DTensor,
                 "__name__": __name__}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(source), "exec"), namespace)
    return namespace


_NAMESPACE = _load()
ModelArgs = _NAMESPACE["ModelArgs"]
Transformer = _NAMESPACE["Transformer"]
HAS_EXPERTS = (all(name in _NAMESPACE for name in EXPERT_CLASSES)
               and "num_experts" in {f.name for f in fields(ModelArgs)})
requires_experts = pytest.mark.skipif(
    not HAS_EXPERTS, reason=f"torch {torch.__version__}'s test Transformer has no experts ({SOURCE.name} defines no "
                            "Experts, ExpertLayer, ModelArgs.num_experts; torch 2.11's has the dense model only)")
