"""``python -m workbench.launch.torchrun TORCHRUN-ARGS``: the entry of :func:`workbench.launch.stores.main`.

A module of its own, which nothing imports, so ``-m`` runs it fresh (the package imports
:mod:`workbench.launch.stores`).
"""

from workbench.launch.stores import main

if __name__ == "__main__":
    main()
