"""Elastic data under torchft: exactly once over the committed steps while replica groups die
and join, with no restart (:class:`ElasticLoader`; docs/elastic.md).

The loader takes the ``torchft.Manager`` the trainer made and needs nothing else from torchft;
:func:`require_torchft` imports torchft itself with an error that says how to install it.
"""

from __future__ import annotations

from types import ModuleType

from torchdata_ext.torchft.exchange import start_allgather
from torchdata_ext.torchft.job import JobState, restore_share, share_state
from torchdata_ext.torchft.loader import ElasticLoader, ManagerLike, share_of_global_batch

__all__ = [
    "ElasticLoader",
    "JobState",
    "ManagerLike",
    "require_torchft",
    "restore_share",
    "share_of_global_batch",
    "share_state",
    "start_allgather",
]


def require_torchft() -> ModuleType:
    """The ``torchft`` module.

    Raises:
        ImportError: torchft is not installed, naming the extra that installs it.
    """
    try:
        import torchft
    except ImportError as exc:
        raise ImportError(
            "torchdata_ext.torchft needs torchft: pip install 'torchdata-ext[torchft]' "
            "(torchft>=0.2)"
        ) from exc
    return torchft
