"""The pipeline nodes, one per module, each a ``torchdata.nodes.BaseNode``.

The ``_``-prefixed modules are not nodes but parts of :class:`Pack` (see :mod:`.pack`).
"""

from torchdata_ext.nodes.collate import Collate
from torchdata_ext.nodes.concat import Concat
from torchdata_ext.nodes.interleave import Interleave
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.reader import ShardReader, merge_reader_states
from torchdata_ext.nodes.shuffle import ShuffleBuffer
from torchdata_ext.nodes.take import Take
from torchdata_ext.nodes.tokenize import Tokenize
from torchdata_ext.nodes.transform import FilterDocuments, MapDocuments, TransformDocuments

__all__ = [
    "Collate",
    "Concat",
    "FilterDocuments",
    "Interleave",
    "MapDocuments",
    "Pack",
    "ShardReader",
    "ShuffleBuffer",
    "Take",
    "Tokenize",
    "TransformDocuments",
    "merge_reader_states",
]
