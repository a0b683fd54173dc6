"""Cache keys: what a stored probe result is valid for, built in one place (:class:`KeySpace`).

A row is served only to the exact (config, backend, device, software stack, code) it was probed
on. The software stack and the code are folded into :func:`versions_key`: library versions, this
package's version, :data:`PROBE_SCHEMA`, a digest of every source that can change a verdict
(:data:`VERDICT_CODE`) and of the probes' settings, so any change is a miss, never a stale hit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import backends

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

#: Bump when a probe's result format or meaning changes (old rows then miss).
PROBE_SCHEMA = 1

#: Everything in the package whose change can change a verdict, relative to the package: the
#: whole probes package (TE's rules, the support table, the graph builders, the cuDNN worker,
#: the stub driver and its C source), the kernels the tiny runs execute, config normalization,
#: the reason model and the backend registry, the tiny runs' problems, the run and cuDNN
#: workers, the device descriptors.
VERDICT_CODE = ("probes", "kernels", "descriptors", "config.py", "config_fields.py",
                "config_te.py", "reasons.py", "backends.py", "problems.py", "run_worker.py",
                "run_worker_serve.py", "workers.py")  # fmt: skip

#: What a ``verify``/``measure`` row depends on beyond the probe rows, per stage.
STAGE_CODE = {"verify": ("verify.py", "problems.py", "kernels"),
              "measure": ("measure.py", "verify.py", "problems.py", "kernels")}  # fmt: skip


def known_backends() -> tuple[str, ...]:
    """Every name a row's backend may have: the registered candidates and their flavours."""
    return backends.units()


def _files(names: Iterable[str]) -> list[Path]:
    root = Path(__file__).resolve().parent.parent
    out: list[Path] = []
    for name in names:
        path = root / name
        if path.is_dir():
            out += sorted(f for f in path.rglob("*") if f.is_file() and "__pycache__" not in
                          f.parts and f.suffix not in (".pyc", ".so"))  # fmt: skip
        elif path.exists():
            out.append(path)
    return out


@functools.lru_cache(maxsize=8)
def code_digest(names: tuple[str, ...] = VERDICT_CODE) -> str:
    """sha256 over the package files ``names`` name (files and whole directories; names and
    bytes, sorted; read once per process): an edit to any of them makes every key new."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for f in _files(names):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return digest.hexdigest()

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

    def problem(self) -> str | None:
        """Why this key is malformed, or ``None`` when it is well formed."""
        for name in ("config_key", "device_fp", "versions_key"):
            if not is_hex64(getattr(self, name)):
                return f"{name} must be 64 lowercase hex characters"
        if self.backend not in known_backends():
            return f"backend {self.backend!r} is not one of {', '.join(known_backends())}"
        return None

    def check(self) -> CacheKey:
        """Return ``self``; raise ``ValueError`` naming the problem if malformed."""
        problem = self.problem()
        if problem:
            raise ValueError(f"bad cache key: {problem}")
        return self


class KeySpace:
    """Every cache key a set of probes' rows live under: the one place keys are built.

    ``env()`` is what the probing process can run, folded into every key: a digest of every
    source that can change a verdict (:func:`code_digest`), of each probe's own module (a probe
    from outside the package too) and settings (whether graphs are built...), and the installed
    cuDNN / cudnn-frontend. A ``verify``/``measure`` row's key adds the stage and a digest of
    its code (:data:`STAGE_CODE`), so probe rows are shared by every policy."""

    def __init__(self, probes: Iterable[Any]):
        self.probes = tuple(probes)
        self._env: dict[str, Any] | None = None
        self._vkeys: dict[tuple[DeviceProfile, str | None], str] = {}

    def env(self) -> dict[str, Any]:
        if self._env is None:
            from ..device import installed_versions

            digest = hashlib.sha256(code_digest().encode())
            for p in self.probes:
                mod = sys.modules.get(type(p).__module__)
                path = getattr(mod, "__file__", None)
                if path and os.path.exists(path):
                    with open(path, "rb") as fh:
                        digest.update(fh.read())
                digest.update(repr(sorted(vars(p).items())).encode())
            inst = installed_versions()
            self._env = {"rules": digest.hexdigest()[:32], "cudnn": inst["cudnn"],
                         "cudnn_frontend": inst["cudnn_frontend"]}  # fmt: skip
        return self._env

    @staticmethod
    def stage_env(stage: str) -> dict[str, Any]:
        """What a ``stage`` row depends on beyond the probe rows: the stage and its code."""
        digest = hashlib.sha256(stage.encode())
        digest.update(code_digest(STAGE_CODE[stage]).encode())
        return {"stage": stage, "code": digest.hexdigest()[:32]}

    def versions(self, device: DeviceProfile, stage: str | None = None) -> str:
        """The versions key of this process's rows for ``device`` (``stage``: verify/measure)."""
        vk = self._vkeys.get((device, stage))
        if vk is None:
            env = self.env() if stage is None else {**self.env(), **self.stage_env(stage)}
            vk = self._vkeys[(device, stage)] = versions_key(device, probe_env=env)
        return vk

    def key(self, config: FusedAttnConfig, backend: str, device: DeviceProfile,
            stage: str | None = None) -> CacheKey:  # fmt: skip
        return CacheKey(config.key(), backend, device.fingerprint(), self.versions(device, stage))

    def keys(self, config: FusedAttnConfig, device: DeviceProfile, names: Iterable[str],
             stage: str | None = None) -> dict[str, CacheKey]:  # fmt: skip
        """``{name: key}`` for each backend/flavour name."""
        vk, ck, fp = self.versions(device, stage), config.key(), device.fingerprint()
        return {n: CacheKey(ck, n, fp, vk) for n in names}
