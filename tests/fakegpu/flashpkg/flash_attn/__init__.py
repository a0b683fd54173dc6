"""Test double of flash-attn 2.8.3: the public functions TE and te-fl-attention call.

Only the kernel is replaced: the inputs are checked the way flash-attn 2.8.3's Python wrapper and
``csrc/flash_attn/flash_api.cpp`` check them (the messages are theirs, paraphrased), then the result
is computed with ``te_fl_attention.kernels.reference`` on whatever device the tensors are on.
"""

__version__ = "2.8.3"

from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
