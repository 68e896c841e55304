"""Run forensics: what a run's batches held, read back from a loader checkpoint.

:func:`~torchdata_ext.forensics.replay.show_batches` replays any steps after a checkpoint
(on its topology or another one) and says, per rank and row, which documents' token ranges
and which packer-placed specials the trainer received; ``torchdata-ext batches`` prints it.
"""

from torchdata_ext.forensics.replay import row_record, show_batches

__all__ = ["row_record", "show_batches"]
