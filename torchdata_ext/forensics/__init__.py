"""Run forensics: what a run's batches held, read back from a loader checkpoint.

:func:`~torchdata_ext.forensics.replay.show_batches` replays any steps after a checkpoint
(on its topology or another one) and says, per rank and row, which documents' token ranges
and which packer-placed specials the trainer received; ``torchdata-ext batches`` prints it.
:class:`~torchdata_ext.forensics.batch_log.BatchLog` writes, as the run goes, which documents
each row of each step held, for the trainer to log with its loss.
"""

from torchdata_ext.forensics.batch_log import BatchLog, batch_documents
from torchdata_ext.forensics.replay import row_record, show_batches

__all__ = ["BatchLog", "batch_documents", "row_record", "show_batches"]
