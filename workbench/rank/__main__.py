"""``python -m workbench.rank --config RUN.json --run-dir DIR`` -- one rank of a torchrun job."""

import sys

from workbench.config import apply_rank_environment, load_config


def _rank_environment(argv: list[str]) -> None:
    """Before torch or megatron can start CUDA: the environment the run's config asks for
    (:func:`workbench.config.rank_environment`).  A config that does not load is left to
    ``main``, which reports it."""
    if "--config" not in argv[:-1]:
        return
    try:
        apply_rank_environment(load_config(argv[argv.index("--config") + 1]))
    except Exception:
        pass


if __name__ == "__main__":
    _rank_environment(sys.argv[1:])
    from workbench.rank.train import main

    sys.exit(main())
