"""The helper process of a large pack import: ``python -m te_fl_attention.cache._pack_check``
checks the rows of the upper half of a pack's keys (:func:`.pack.helper_main`)."""

from __future__ import annotations

from .pack import helper_main

if __name__ == "__main__":
    helper_main()
