"""GPT's rank side (declaration: :mod:`workbench.families.gpt`): :mod:`.model` (specs and builder), :mod:`.step`
(default forward step and LM loss), :mod:`.data` (GPT datasets), :mod:`.hf` (HF GPT-2 / Llama adapter, with
:mod:`.hf_moe` for Mixtral / Qwen3-MoE), :mod:`.generate` (the decoder-only engine), :mod:`.router_stats`
(the MoE router statistics, the trainer's per-step monitor)."""
