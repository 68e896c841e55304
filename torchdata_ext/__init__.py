"""torchdata-ext: stateful, rescalable torchdata.nodes pipelines for LLM pre-training.

The standard pipeline, stage by stage: file handlers (:mod:`torchdata_ext.handlers`) read
shard files over fsspec; :class:`DatasetIndex` lists and counts a dataset's documents;
:class:`ShardReader` cuts them into logical shards and walks each shard in a seeded random
order, exactly once per epoch, with a small per-shard state that survives restarts.
"""

from torchdata_ext.document import Document, DocumentBlock
from torchdata_ext.index import DatasetIndex
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.walk import RandomWalk, mix_seed
from torchdata_ext.world import World

__all__ = [
    "DatasetIndex",
    "Document",
    "DocumentBlock",
    "RandomWalk",
    "ShardReader",
    "World",
    "mix_seed",
]

__version__ = "0.1.0"
