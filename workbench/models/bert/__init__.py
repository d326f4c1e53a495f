"""BERT's rank side (declaration: :mod:`workbench.families.bert`): :mod:`.model` (spec and builder), :mod:`.step`
(default forward step; MLM + sentence-order loss), :mod:`.data` (masked-LM datasets, and the labelled sets of
:mod:`.finetune`), :mod:`.hf` (HF ``MegatronBertForPreTraining`` adapter), :mod:`.fill_mask`."""
