"""``python -m routeformer`` is the ``routeformer`` command (so ``torchrun -m routeformer …`` works)."""

import sys

from .cli import main

sys.exit(main())
