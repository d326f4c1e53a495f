"""What the family declarations share: the transformer stack's shape terms (:mod:`.shapes`, with the
mixture-of-experts terms :mod:`.moe_shapes`) and the ``model.moe`` section (:mod:`.moe`).  Torch-free."""
