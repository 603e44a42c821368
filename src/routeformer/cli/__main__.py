"""``python -m routeformer.cli`` is the ``routeformer`` command too."""

import sys

from . import main

sys.exit(main())
