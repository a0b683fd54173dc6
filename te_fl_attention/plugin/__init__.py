"""TransformerEngine plugin side of te-fl-attention (``NVTE_PLUGIN`` hook, op registry)."""
