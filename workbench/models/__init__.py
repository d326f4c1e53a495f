"""The families' rank side: ``workbench/models/<family>/``, one folder each, above the backend's building blocks.

A family's torch-free declaration is :mod:`workbench.families` (below the config); its folder here holds its
parts, one module a part (``model``, ``step``, ``data``; ``hf``, ``generate``, ``router_stats`` where it has
them), which :func:`workbench.models.parts.parts_of` imports where they are first asked for.  They import
the backend's building blocks, the rule vocabulary of conversion (:mod:`workbench.models.common.conversion_rules`)
and their family's declaration, never the other way round; the conversion tools (:mod:`workbench.conversion`)
stand above them.  What the rank sides share lives in :mod:`workbench.models.common`.
"""
