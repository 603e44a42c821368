"""``python -m routeformer.bench attention …`` is ``routeformer bench attention …``."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
