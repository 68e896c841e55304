"""``python -m torchdata_ext prepare|inspect ...``: the ``torchdata-ext`` command."""

import sys

from torchdata_ext.cli import main

sys.exit(main())
