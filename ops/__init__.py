"""globaltensor.ops: SBP signature rules (one file per op family) and the one dispatcher."""
from . import registry  # noqa: F401  (rules register themselves on import, below)
from . import attention, attention_cuda, embedding, loss, matrix, normalization, optimizer, pointwise, random, reduction, view  # noqa: F401
from . import indexing, norm, sorting  # noqa: F401
from . import batchnorm, complex, datadependent, scalar, variance  # noqa: F401
from . import inplace_view, strided, view_copies  # noqa: F401
from . import fft, linalg  # noqa: F401
from . import structural  # noqa: F401
from . import products  # noqa: F401
from . import channel_norm, conv, embedding_bag, spatial  # noqa: F401  (vision and audio layers: issue 34)
from . import out_variants  # noqa: F401  (after every rule: it takes the out= overloads none names)
from .attention import attention_method
from .dispatch import check_replicated, clear_cache, reset_stats, stats
from . import step_plan as _step_plan  # noqa: F401  (gt.step_plan, gt.StepPlan come from it)

__all__ = ["attention_method", "stats", "reset_stats", "check_replicated", "clear_cache"]
