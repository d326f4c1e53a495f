"""T5's rank side (declaration: :mod:`workbench.families.t5`): :mod:`.model` (encoder / decoder specs and the
builder), :mod:`.step` (forward step and the decoder's LM loss), :mod:`.data` (span-corruption datasets),
:mod:`.hf` (HF T5 / mT5 adapter), :mod:`.generate` (encoder once, decoder with KV caches)."""
