"""Cache keys: what a stored probe result is valid for.

A row is served only to the exact (config, backend, device, software stack) it was probed on. The
software stack is folded into :func:`versions_key`: library versions, this package's version and
:data:`PROBE_SCHEMA`, so any change is a miss, never a wrong hit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from ..reasons import BACKENDS, FLASH_FLAVOURS

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

#: Bump when a probe's result format or meaning changes (old rows then miss).
PROBE_SCHEMA = 1

#: Every backend name a row may carry: the candidates and the flash-attn flavours.
KNOWN_BACKENDS: tuple[str, ...] = (*BACKENDS, *FLASH_FLAVOURS)

_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_hex64(value: Any) -> bool:
    """True for a lowercase 64-character hex string (a sha256 digest)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """This package's version: installed metadata, else ``te_fl_attention.__version__``."""
    from importlib import metadata

    try:
        return metadata.version("te-fl-attention")
    except metadata.PackageNotFoundError:
        import te_fl_attention

        return str(getattr(te_fl_attention, "__version__", "0+unknown"))


def versions_key(
    device: DeviceProfile,
    probe_schema: int = PROBE_SCHEMA,
    *,
    package: str | None = None,
    probe_env: Any = None,
) -> str:
    """sha256 over the device's library versions, this package's version, ``probe_schema`` and
    ``probe_env`` (what the probing process can run: installed cuDNN, a digest of the rules...).

    ``package`` overrides the package version (tests, imports of other versions' rows).
    """
    payload = {
        "versions": device.versions(),
        "package": package if package is not None else package_version(),
        "probe_schema": probe_schema,
    }
    if probe_env is not None:
        payload["probe_env"] = probe_env
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class CacheKey(NamedTuple):
    """The four parts a cached row is keyed on (all but ``backend`` are sha256 hex digests)."""

    config_key: str
    backend: str
    device_fp: str
    versions_key: str

    @classmethod
    def make(
        cls,
        config: FusedAttnConfig,
        backend: str,
        device: DeviceProfile,
        *,
        probe_schema: int = PROBE_SCHEMA,
    ) -> CacheKey:
        """The key of ``backend``'s result for ``config`` on ``device``."""
        return cls(config.key(), backend, device.fingerprint(), versions_key(device, probe_schema))

    def problem(self) -> str | None:
        """Why this key is malformed, or ``None`` when it is well formed."""
        for name in ("config_key", "device_fp", "versions_key"):
            if not is_hex64(getattr(self, name)):
                return f"{name} must be 64 lowercase hex characters"
        if self.backend not in KNOWN_BACKENDS:
            return f"backend {self.backend!r} is not one of {', '.join(KNOWN_BACKENDS)}"
        return None

    def check(self) -> CacheKey:
        """Return ``self``; raise ``ValueError`` naming the problem if malformed."""
        problem = self.problem()
        if problem:
            raise ValueError(f"bad cache key: {problem}")
        return self
