"""The pipeline nodes, one per module, each a ``torchdata.nodes.BaseNode``."""

from torchdata_ext.nodes.reader import ShardReader, merge_reader_states

__all__ = ["ShardReader", "merge_reader_states"]
