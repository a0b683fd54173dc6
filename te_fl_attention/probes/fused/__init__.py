"""FusedAttention (cuDNN): TE 2.20.2's Python-side filters, its C++ refusals, and a prediction of
cuDNN's own verdict.

Three rule groups run here, each TE condition stated once, in the group where TE decides it:

* ``PYTHON_RULES`` (and ``determinism``) mirror ``get_attention_backend``'s FusedAttention
  filters (codes ``fused.*``). Binding.
* ``CPP_RULES`` mirror what TE 2.20.2's C++ query ``nvte_get_fused_attn_backend_v2``
  (``fused_attn.cpp``) refuses *before* it builds a cuDNN graph (codes ``fused_cpp.*``). Binding
  too: TE never asks cuDNN for these configs, whatever cuDNN would say.
* ``TABLE_RULES`` predict what cuDNN itself answers for TE's graphs when cuDNN cannot be asked
  (another cuDNN version than the installed one, no cudnn-frontend): stage ``rule``, codes
  ``cudnn_table.*``. The real graph-build probe runs after the binding rules when cudnn-frontend
  is available, and its verdict replaces the prediction (a disagreement is ``rule_drift``).

``fused_sub_backend`` names TE's sub-backend: 1 (F16_arbitrary_seqlen) or 2 (FP8).
"""
