"""What the families' rank sides share: the token-mean LM loss (:mod:`.lm_loss`), the per-sample seeds of
synthetic data (:mod:`.seeds`), the per-tensor rules the HF adapters are written in (:mod:`.conversion_rules`)
and a family's model in one CPU process (:mod:`.one_process`: conversion's and fill-mask's).  The shared shape
terms and the ``model.moe`` section are declarations: :mod:`workbench.families.common`."""
