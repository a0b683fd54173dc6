"""``python -m te_fl_attention.cli ...`` (the same as ``te-fl-attn ...``)."""

import sys

from . import main

sys.exit(main())
