"""Running a pipeline: :class:`TokenLoader` under ``StatefulDataLoader`` workers, its background
thread, the shared-memory token ring, and the evaluation loader.
"""

from torchdata_ext.loader.evaluation import (
    ROW_MASK,
    EvalLoader,
)
from torchdata_ext.loader.token_loader import (
    STATE_FORMAT,
    PipelineDataset,
    TokenLoader,
)

__all__ = [
    "EvalLoader",
    "PipelineDataset",
    "ROW_MASK",
    "STATE_FORMAT",
    "TokenLoader",
]
