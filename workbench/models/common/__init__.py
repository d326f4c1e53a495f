"""What the families' rank sides share: the token-mean LM loss (:mod:`.lm_loss`) and the per-sample seeds of
synthetic data (:mod:`.seeds`).  The shared shape terms and the ``model.moe`` section are declarations:
:mod:`workbench.families.common`."""
