"""The standard pre-training pipeline: :class:`PipelineConfig`, the builder, and curriculum phases."""

from torchdata_ext.pipeline.build import build_datasets, build_eval_pipeline, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig

__all__ = [
    "PipelineConfig",
    "build_datasets",
    "build_eval_pipeline",
    "build_pipeline",
]
