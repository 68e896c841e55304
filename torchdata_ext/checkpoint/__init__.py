"""Save, restore and rescale a loader: the checkpoint folder, the DCP state, and the rescale of
worker states to another topology.
"""

from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.dcp_load import check_dcp, load_dcp
from torchdata_ext.checkpoint.folder import (
    CHECKPOINT_FORMAT,
    is_checkpoint_folder,
    load_checkpoint,
    read_manifest,
    read_worker_states,
    save_checkpoint,
)
from torchdata_ext.checkpoint.rescale import rescale_worker_states
from torchdata_ext.checkpoint.restore import dataset_differs

__all__ = [
    "CHECKPOINT_FORMAT",
    "DCPLoaderState",
    "check_dcp",
    "dataset_differs",
    "is_checkpoint_folder",
    "load_checkpoint",
    "load_dcp",
    "read_manifest",
    "read_worker_states",
    "rescale_worker_states",
    "save_checkpoint",
]
