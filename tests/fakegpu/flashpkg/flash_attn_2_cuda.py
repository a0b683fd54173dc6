"""The compiled extension of the flash-attn 2.8.3 test double: TE imports ``varlen_bwd`` from it
(for context parallelism); the double implements only the public Python entry points."""

from flash_attn.flash_attn_interface import _not_in_double

fwd = _not_in_double("flash_attn_2_cuda.fwd")
bwd = _not_in_double("flash_attn_2_cuda.bwd")
varlen_fwd = _not_in_double("flash_attn_2_cuda.varlen_fwd")
varlen_bwd = _not_in_double("flash_attn_2_cuda.varlen_bwd")
