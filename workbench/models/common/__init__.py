"""What model families share: the transformer stack's shape terms (:mod:`.shapes`, with the
mixture-of-experts terms :mod:`.moe_shapes` and the ``model.moe`` section :mod:`.moe`), the
token-mean LM loss (:mod:`.lm_loss`) and the per-sample seeds of synthetic data (:mod:`.seeds`).
Torch-free at import."""
