"""The old path of :mod:`torchdata_ext.sources.fingerprint`, kept so that imports written for it
(``from torchdata_ext.fingerprint import ChangedFilesError``, as the docs once said) still work.

Importing it warns with a ``DeprecationWarning`` naming the new places:
``from torchdata_ext import ChangedFilesError`` (the root) or
:mod:`torchdata_ext.sources.fingerprint`.
"""

from __future__ import annotations

import warnings

from torchdata_ext.sources.fingerprint import *  # noqa: F403 (the alias re-exports every name)
from torchdata_ext.sources.fingerprint import __all__ as __all__

warnings.warn(
    "torchdata_ext.fingerprint moved to torchdata_ext.sources.fingerprint; import "
    "ChangedFilesError from torchdata_ext itself (from torchdata_ext import ChangedFilesError)",
    DeprecationWarning,
    stacklevel=2,
)
