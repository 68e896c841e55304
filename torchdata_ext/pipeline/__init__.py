"""The standard pre-training pipeline: :class:`PipelineConfig`, the builder, and curriculum phases."""

from torchdata_ext.pipeline.build import (
    PipelineConfig,
    build_datasets,
    build_eval_pipeline,
    build_pipeline,
)

__all__ = [
    "PipelineConfig",
    "build_datasets",
    "build_eval_pipeline",
    "build_pipeline",
]
