"""Suite-wide isolation: the probe cache lives in a temporary file, never the user's cache."""

from __future__ import annotations

import os
import tempfile

_CACHE_DIR = tempfile.mkdtemp(prefix="te-fl-attn-tests-")
os.environ.setdefault("TE_FL_ATTN_CACHE", os.path.join(_CACHE_DIR, "probes.sqlite"))
