"""The rank entry point: one process of a torchrun job, above the model families it runs.

``python -m workbench.rank --config RUN.json --run-dir DIR`` trains (:mod:`.train`: the loop and the events it
writes; :mod:`.build`, :mod:`.data`: the config's family's model chunks and datasets, through
:func:`workbench.models.parts.parts_of`; :mod:`.metrics`, :mod:`.timing`: what a step event reports), and
``python -m workbench.rank.inference`` serves generation's requests (:mod:`.inference`).  It stands above
``workbench/models/<family>/``, which build from the blocks of ``workbench/backend/``; neither imports it.
"""
