"""``python -m workbench.backend --config RUN.json --run-dir DIR`` -- one rank of a torchrun job."""

import sys

from workbench.backend.train import main

if __name__ == "__main__":
    sys.exit(main())
