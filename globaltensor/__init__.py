"""globaltensor: global tensors for PyTorch in the SBP style.

Start at README.md and docs/: `gt.placement` (ranks as a mesh), `gt.split`/`gt.broadcast`/`gt.partial`
(one SBP per mesh axis), `gt.to_global`/`gt.from_local` (tensors and modules), `gt.launch` (ranks).
"""
from importlib import metadata as _metadata

from .api import PlanLike, from_local, to_global
from .layout import Layout
from .parallel.module import ModuleLayout, zero_plan
from .placement import Placement, node_mesh, placement
from .runtime import CollectiveError, RankError, comm_log, launch, rank, world_size
from .sbp import SBP, SbpLike, Broadcast, Partial, Ragged, Split, Strided, Zigzag, broadcast, partial, partial_sum, ragged, split, strided, zigzag
from .raggedtensor.ops import RaggedTensor
from .raggedtensor.grouped import Routing, by_expert, by_group, grouped_linear
from .tensor import GlobalTensor, StridedTensor, ZigzagTensor
from .factory import empty, ones, rand, randn, zeros
from .parallel.pipeline import Pipeline
from .parallel import zero
from .parallel import optim_skip as _optim_skip  # noqa: F401  (its optimizer step hooks)
from .ops import attention_method, check_replicated, reset_stats, stats
from .ops.step_plan import StepPlan, step_plan
from .tools.report import comm_report
from .tools.visualize import visualize
from .tools.explain import explain
from .calibrate import Calibration, calibrate, link_model
from .runtime.topology import Link, LinkModel
from . import data, hf
from .planning import AutoPlan, auto_plan

try:
    __version__ = _metadata.version("globaltensor")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed: pyproject's version
    __version__ = "0.1.0"

__all__ = ["SbpLike", "PlanLike", "from_local", "to_global", "Layout", "ModuleLayout", "Pipeline", "Placement", "placement", "node_mesh", "CollectiveError", "RankError",
           "comm_log", "launch", "rank", "world_size", "SBP", "Broadcast", "Partial", "Split", "broadcast",
           "partial", "partial_sum", "split", "Ragged", "ragged", "RaggedTensor",
           "Zigzag", "zigzag", "ZigzagTensor", "Strided", "strided", "StridedTensor",
           "Routing", "by_expert", "by_group", "grouped_linear", "GlobalTensor",
           "empty", "ones", "rand", "randn", "zeros", "stats", "reset_stats", "check_replicated",
           "comm_report", "visualize", "explain", "attention_method", "StepPlan", "step_plan", "zero", "hf", "data",
           "auto_plan", "AutoPlan", "zero_plan", "calibrate", "link_model", "Link", "LinkModel", "Calibration"]
