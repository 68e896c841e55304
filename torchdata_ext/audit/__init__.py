"""What a checkpoint consumed (:func:`audit_checkpoint`), what a dataset holds
(:func:`inspect_dataset`), and what every delivered row must look like.
"""

from torchdata_ext.audit.consumption import DatasetAudit, EpochConsumption
from torchdata_ext.audit.inspect_data import (
    histogram,
    inspect_dataset,
    open_index,
)
from torchdata_ext.audit.report import AuditReport, audit_checkpoint

__all__ = [
    "AuditReport",
    "DatasetAudit",
    "EpochConsumption",
    "audit_checkpoint",
    "histogram",
    "inspect_dataset",
    "open_index",
]
