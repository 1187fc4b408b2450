"""``python -m memfit ...``: the ``memfit`` command, with the same exit codes.

Example::

    python -m memfit train --steps 50 --precision fp32
"""

from __future__ import annotations

import sys

from memfit.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
