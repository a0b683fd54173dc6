"""`DeviceProfile`: the GPU (real or named) a decision is made for, and the library versions on it.

`local()` reads the real machine; `profile("h100")` returns a catalog entry for what-if questions.
Unknown fields are ``None`` and shown as unknown, never guessed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import metadata
from typing import Any

from packaging.version import InvalidVersion, Version

from .frozen import hash_once

#: Version fields a catalog entry can override with ``name:field=value``.
VERSION_FIELDS = (
    "driver", "cuda", "cudnn", "torch", "triton", "flash_attn", "flash_attn_3", "flash_attn_4",
    "transformer_engine", "cudnn_frontend",
)  # fmt: skip
_ALIASES = {"fa2": "flash_attn", "fa3": "flash_attn_3", "fa4": "flash_attn_4",
            "te": "transformer_engine", "flash_attn_2": "flash_attn"}  # fmt: skip

#: Distribution names read from installed metadata (first found wins).
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "flash_attn": ("flash-attn", "flash_attn"),
    "flash_attn_3": ("flash-attn-3", "flash_attn_3"),
    "flash_attn_4": ("flash-attn-4", "flash_attn_4"),
    "transformer_engine": ("transformer-engine", "transformer_engine"),
    "cudnn_frontend": ("nvidia-cudnn-frontend",),
    "cudnn": ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
}


@hash_once
@dataclass(frozen=True)
class DeviceProfile:
    """A GPU and its software stack. ``sm`` is ``10 * major + minor``; ``None`` means no GPU."""

    name: str
    sm: int | None = None
    sm_count: int | None = None
    memory_gib: float | None = None
    driver: str | None = None
    cuda: str | None = None
    cudnn: str | None = None
    torch: str | None = None
    triton: str | None = None
    flash_attn: str | None = None
    flash_attn_3: str | None = None
    flash_attn_4: str | None = None
    transformer_engine: str | None = None
    cudnn_frontend: str | None = None
    source: str = "local"

    @property
    def has_gpu(self) -> bool:
        return self.sm is not None

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        return None if self.sm is None else (self.sm // 10, self.sm % 10)

    def version(self, name: str) -> str | None:
        """An installed library's version string (``None``: not installed or unknown)."""
        return getattr(self, _ALIASES.get(name, name))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceProfile:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown device field(s) {', '.join(unknown)}; allowed: "
                             f"{', '.join(sorted(names))}")  # fmt: skip
        return cls(**dict(d))

    def versions(self) -> dict[str, str | None]:
        """The software stack: every library version that can change a verdict."""
        return {k: getattr(self, k) for k in VERSION_FIELDS}

    def fingerprint(self) -> str:
        """sha256 of the hardware identity (name, sm, SM count, memory): a cache key part (the
        versions part is :class:`te_fl_attention.cache.keys.KeySpace`'s)."""
        cached = self.__dict__.get("_fp")
        if cached is None:
            hw = {k: getattr(self, k) for k in ("name", "sm", "sm_count", "memory_gib")}
            cached = hashlib.sha256(json.dumps(hw, sort_keys=True).encode()).hexdigest()
            object.__setattr__(self, "_fp", cached)
        return cached

    def with_overrides(self, overrides: Mapping[str, str]) -> DeviceProfile:
        """A copy with fields replaced; ``"none"`` means not installed / unknown (no GPU for
        ``sm``). Every value is checked (:func:`override_value`); keys are case-insensitive."""
        changes: dict[str, Any] = {}
        for raw_key, raw in overrides.items():
            key = override_key(raw_key)
            if key in changes:
                raise ValueError(f"device override {key} is given twice ({raw_key}={raw!r})")
            changes[key] = override_value(key, raw)
        return dataclasses.replace(self, **changes) if changes else self


#: Compute capabilities of the GPU architectures CUDA 12/13 know (``sm`` = 10 * major + minor).
KNOWN_SM = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120,
            121)  # fmt: skip
#: Bounds of the hardware overrides (positive, and no more than any GPU has by far).
MAX_SM_COUNT = 4096
MAX_MEMORY_GIB = 65536.0
OVERRIDE_FIELDS = (*VERSION_FIELDS, "sm", "sm_count", "memory_gib")
_ASCII_INT = re.compile(r"[0-9]+")
_ASCII_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def override_key(raw_key: str) -> str:
    """The profile field an override names (aliases ``fa2``/``fa3``/``fa4``/``te``; any case)."""
    low = raw_key.strip().lower()
    key = _ALIASES.get(low, low)
    if key not in OVERRIDE_FIELDS:
        aliases = ", ".join(f"{a} ({k})" for a, k in _ALIASES.items())
        raise ValueError(f"unknown device override {raw_key!r}; allowed: "
                         f"{', '.join(OVERRIDE_FIELDS)}; aliases: {aliases}")  # fmt: skip
    return key


def override_value(key: str, raw: str) -> Any:
    """The checked value of one override: a PEP 440 version for a library, a known
    architecture for ``sm``, a positive count/size for ``sm_count``/``memory_gib``; ``none``
    (any case) means not installed / unknown."""
    text = raw.strip() if isinstance(raw, str) else raw
    if not isinstance(text, str) or not text or len(text) > 100:
        raise ValueError(f"device override {key}={raw!r} is not valid: expected a value of 1 to "
                         "100 characters (none for not installed)")  # fmt: skip
    if text.lower() == "none":
        return None
    if key in VERSION_FIELDS:
        try:
            Version(text)
        except InvalidVersion:
            raise ValueError(f"device override {key}={raw!r} is not valid: expected a version "
                             "such as 9.10.2 or 2.8.3 (PEP 440), or none") from None  # fmt: skip
        return text
    if key == "sm":
        if _ASCII_INT.fullmatch(text) and int(text) in KNOWN_SM:
            return int(text)
        raise ValueError(f"device override sm={raw!r} is not valid: expected a known "
                         f"architecture ({', '.join(map(str, KNOWN_SM))}), or none")  # fmt: skip
    if key == "sm_count":
        if _ASCII_INT.fullmatch(text) and 1 <= int(text) <= MAX_SM_COUNT:
            return int(text)
        raise ValueError(f"device override sm_count={raw!r} is not valid: expected an integer "
                         f"in [1, {MAX_SM_COUNT}], or none")  # fmt: skip
    if _ASCII_NUMBER.fullmatch(text) and 0 < float(text) <= MAX_MEMORY_GIB:  # memory_gib
        return float(text)
    raise ValueError(f"device override memory_gib={raw!r} is not valid: expected a number in "
                     f"(0, {MAX_MEMORY_GIB:g}], or none")  # fmt: skip


# ---------------------------------------------------------------------------------------- catalog
# The software stack assumed for what-if questions: the newest releases TE 2.20.2 supports that
# install from PyPI today. Override per question: "a100:cudnn=9.10.2,flash_attn=none".
_ASSUMED_STACK = dict(
    cuda="13.0",
    cudnn="9.28.1",  # nvidia-cudnn-cu13 9.28.1.4 on PyPI
    torch="2.13.0",
    triton="3.7.1",  # the triton pinned by torch 2.13.0's CUDA wheel
    flash_attn="2.8.3",  # newest flash-attn 2 inside TE 2.20's range [2.1.1, 2.8.4)
    flash_attn_3=None,
    flash_attn_4=None,
    transformer_engine="2.20.2",
    cudnn_frontend="1.32.0",
)

CATALOG: dict[str, DeviceProfile] = {
    # A100 SXM4 80GB: compute capability 8.0, 108 SMs, 80 GB HBM2e.
    # Source: NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), table 3; A100 datasheet.
    "a100": DeviceProfile(
        "a100", sm=80, sm_count=108, memory_gib=80.0, source="catalog", **_ASSUMED_STACK
    ),
    # H100 SXM5: compute capability 9.0, 132 SMs, 80 GB HBM3.
    # Source: NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table 3.
    "h100": DeviceProfile(
        "h100", sm=90, sm_count=132, memory_gib=80.0, source="catalog", **_ASSUMED_STACK
    ),
    # H200 SXM: compute capability 9.0 (GH100 die, as H100 SXM5: 132 SMs), 141 GB HBM3e.
    # Source: NVIDIA H200 Tensor Core GPU datasheet (2024).
    "h200": DeviceProfile(
        "h200", sm=90, sm_count=132, memory_gib=141.0, source="catalog", **_ASSUMED_STACK
    ),
    # B200 (HGX/DGX B200): compute capability 10.0, 148 SMs, 180 GB HBM3e per GPU.
    # Source: NVIDIA Blackwell architecture technical brief (2024); DGX B200 datasheet
    # (1,440 GB total for 8 GPUs); CUDA C++ Programming Guide, compute capabilities table.
    "b200": DeviceProfile(
        "b200", sm=100, sm_count=148, memory_gib=180.0, source="catalog", **_ASSUMED_STACK
    ),
    # L40S: compute capability 8.9, 142 SMs, 48 GB GDDR6.
    # Source: NVIDIA L40S datasheet (2023); NVIDIA Ada GPU Architecture whitepaper.
    "l40s": DeviceProfile(
        "l40s", sm=89, sm_count=142, memory_gib=48.0, source="catalog", **_ASSUMED_STACK
    ),
    # GeForce RTX 4090: compute capability 8.9, 128 SMs, 24 GB GDDR6X.
    # Source: NVIDIA Ada GPU Architecture whitepaper (2022), appendix table (AD102, RTX 4090).
    "rtx4090": DeviceProfile(
        "rtx4090", sm=89, sm_count=128, memory_gib=24.0, source="catalog", **_ASSUMED_STACK
    ),
    # GeForce RTX 5090: compute capability 12.0, 170 SMs, 32 GB GDDR7.
    # Source: NVIDIA RTX Blackwell GPU Architecture whitepaper (2025); CUDA C++ Programming Guide.
    "rtx5090": DeviceProfile(
        "rtx5090", sm=120, sm_count=170, memory_gib=32.0, source="catalog", **_ASSUMED_STACK
    ),
    # Tesla T4: compute capability 7.5, 40 SMs, 16 GB GDDR6 (below every fused/flash minimum).
    # Source: NVIDIA T4 datasheet; NVIDIA Turing GPU Architecture whitepaper (2018).
    "t4": DeviceProfile(
        "t4", sm=75, sm_count=40, memory_gib=16.0, source="catalog", **_ASSUMED_STACK
    ),
}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"h100:cudnn=9.10,flash_attn=none"`` -> ``("h100", {"cudnn": "9.10", ...})``. Names and
    keys are case-insensitive (lowercased); an empty name, an empty or malformed item, or a key
    given twice is an error."""
    if not isinstance(spec, str):
        raise ValueError(f"device={spec!r} is not valid: expected a name such as h100 or "
                         "h100:cudnn=9.10.2")  # fmt: skip
    name, colon, rest = spec.partition(":")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"device={spec!r} is not valid: expected a name before ':' (local, "
                         f"{', '.join(sorted(CATALOG))})")  # fmt: skip
    overrides: dict[str, str] = {}
    if colon and not rest.strip():
        raise ValueError(f"device={spec!r} is not valid: expected field=value,... after ':'")
    for item in (p.strip() for p in rest.split(",")) if colon else ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"device override {item!r} in {spec!r}: expected field=value "
                             "(none for not installed)")  # fmt: skip
        key = key.strip().lower()
        if key in overrides:
            raise ValueError(f"device override {key} is given twice in {spec!r}")
        overrides[key] = value.strip()
    return name, overrides


def profile(spec: str | DeviceProfile | None = None) -> DeviceProfile:
    """Resolve ``None``/``"local"``, a catalog name, or ``"name:field=value,..."``."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None:
        return local()
    name, overrides = parse_spec(spec)
    if name == "local":
        base = local()
    elif name in CATALOG:
        base = CATALOG[name]
    else:
        raise ValueError(
            f"device={name!r} is not known; allowed: local, {', '.join(sorted(CATALOG))}"
        )
    return base.with_overrides(overrides)


# ------------------------------------------------------------------------------------------ local
def _dist_version(names: tuple[str, ...]) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> dict[str, str | None]:
    """Library versions from installed package metadata (no imports)."""
    return {k: _dist_version(v) for k, v in _DISTRIBUTIONS.items()}


def _nvml_gpu() -> dict[str, Any] | None:
    """The first GPU as NVML reports it (name, sm, memory, driver), or ``None`` without NVML.

    The torch query below overrides name, sm and memory with the *current* device's when torch
    sees a GPU; NVML then only contributes the driver version."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML library / no driver
        return None
    try:  # gpu-only
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        name = pynvml.nvmlDeviceGetName(h)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {
            "name": name.decode() if isinstance(name, bytes) else name,
            "sm": 10 * major + minor,
            "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
        }
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _torch_gpu() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    info: dict[str, Any] = {"cuda": torch.version.cuda}
    if torch.cuda.is_available():  # gpu-only
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            name=props.name,
            sm=10 * props.major + props.minor,
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if v:
            info["cudnn"] = f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
    return info


@functools.lru_cache(maxsize=1)
def local() -> DeviceProfile:
    """The real machine: the first GPU (NVML, then torch.cuda) and installed library versions.

    On a machine without a GPU, ``sm`` is ``None``. Cached for the process.
    """
    versions = installed_versions()
    gpu: dict[str, Any] = {}
    nvml = _nvml_gpu()
    if nvml:
        gpu.update(nvml)
    if nvml or "torch" in sys.modules or versions["torch"]:
        tinfo = _torch_gpu() or {}
        gpu.update({k: v for k, v in tinfo.items() if v is not None})
    if "cudnn" in gpu:
        versions["cudnn"] = gpu.pop("cudnn")
    name = gpu.pop("name", "local (no GPU)")
    return DeviceProfile(name=name, source="local", **{**versions, **gpu})
