"""``python -m workbench.launch supervise|exit-status ...``: the supervisor and the exit-status recorder
(:func:`workbench.launch.supervisor.main`)."""

import sys

from workbench.launch.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
