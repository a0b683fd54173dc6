"""FlashAttention (flash-attn 2, 3 and 4): TE 2.20's rule stage for each flavour, then, on the
local device, the real import and one tiny call.

The candidate ``flash`` has three variants. Rules TE applies to "FlashAttention" as a whole
(clearing its umbrella flag) are shared; each flavour adds its own. Precedence among supported
flavours is TE's: FA4 > FA3 > FA2. FA4's head dims are judged by flash-attn-4's own
``_validate_head_dims`` (loaded from the installed source, stage ``import``) when the device's FA4
is the installed one, else by our statement of its limits (stage ``rule``).
"""

