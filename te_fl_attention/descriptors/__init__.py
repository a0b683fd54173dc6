"""cuDNN device descriptors: the JSON that ``cudnn.create_device_properties`` turns into a "device".

cuDNN (>= 9.11) can plan for a GPU it does not have ("deviceless" mode): a descriptor of the
device's properties plus an ``sm_version`` replace the real device. One JSON file per catalog GPU
lives next to this module (package data); every value is cited in its ``"_sources"`` key and in
``SOURCES.md``, and ``"_estimated"`` lists the fields that are estimates rather than published
numbers. Keys starting with ``_`` are ours and are stripped by :func:`cudnn_json`.

Which fields cuDNN 9.28.1 demands was measured by removing each in turn: all of
:data:`REQUIRED_FIELDS` (a missing one gives ``!json_object.HasMember(...)``,
``CUDNN_STATUS_BAD_PARAM``); :data:`OPTIONAL_FIELDS` may be left out. Integers must be JSON
integers (``false`` or ``1.5`` are rejected), ``smCountOrigin`` must be 0 or 1 and ``deviceVer`` is
the compute capability times 100 (``900`` for sm90).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..device import DeviceProfile

#: Catalog GPUs that ship a descriptor (the names of ``te_fl_attention.device.CATALOG``).
CATALOG_NAMES = ("a100", "h100", "h200", "b200", "l40s", "rtx4090", "rtx5090", "t4")

#: Fields cuDNN 9.28.1 rejects a descriptor without (measured).
REQUIRED_FIELDS = (
    "maxGridSize",
    "maxBlockSize",
    "regsPerBlock",
    "multiProcessorCount",
    "warpSize",
    "maxSharedMemoryPerBlock",
    "maxSharedMemoryPerBlockOptin",
    "reservedSharedMemoryPerBlock",
    "maxRegistersPerSM",
    "maxCtasPerSM",
    "maxThreadsPerBlock",
    "maxThreadsPerSM",
    "pciDeviceId",
    "isTccDriver",
    "supportCoopLaunch",
    "totalGlobalMem",
    "smClockRateKHz",
    "memClockRateKHz",
    "memoryBusWidth",
    "l2CacheSize",
    "cudaDeviceId",
    "deviceVer",
    "driverVer",
    "deviceName",
)

#: Fields cuDNN reads when present (our files always carry them).
OPTIONAL_FIELDS = ("smCountOrigin", "oversizedSharedMemoryPerBlock")

#: Per-compute-capability limits, from the CUDA C++ Programming Guide's "Technical
#: Specifications per Compute Capability" table (see SOURCES.md). sm -> field -> value.
CC_LIMITS: dict[int, dict[str, int]] = {
    75: {
        "maxThreadsPerSM": 1024,
        "maxCtasPerSM": 16,
        "maxSharedMemoryPerBlockOptin": 65536,
        "reservedSharedMemoryPerBlock": 0,
    },
    80: {
        "maxThreadsPerSM": 2048,
        "maxCtasPerSM": 32,
        "maxSharedMemoryPerBlockOptin": 166912,
        "reservedSharedMemoryPerBlock": 1024,
    },
    86: {
        "maxThreadsPerSM": 1536,
        "maxCtasPerSM": 16,
        "maxSharedMemoryPerBlockOptin": 101376,
        "reservedSharedMemoryPerBlock": 1024,
    },
    89: {
        "maxThreadsPerSM": 1536,
        "maxCtasPerSM": 24,
        "maxSharedMemoryPerBlockOptin": 101376,
        "reservedSharedMemoryPerBlock": 1024,
    },
    90: {
        "maxThreadsPerSM": 2048,
        "maxCtasPerSM": 32,
        "maxSharedMemoryPerBlockOptin": 232448,
        "reservedSharedMemoryPerBlock": 1024,
    },
    100: {
        "maxThreadsPerSM": 2048,
        "maxCtasPerSM": 32,
        "maxSharedMemoryPerBlockOptin": 232448,
        "reservedSharedMemoryPerBlock": 1024,
    },
    120: {
        "maxThreadsPerSM": 1536,
        "maxCtasPerSM": 32,
        "maxSharedMemoryPerBlockOptin": 101376,
        "reservedSharedMemoryPerBlock": 1024,
    },
}

#: Limits shared by every compute capability >= 7.5 (same table).
COMMON_LIMITS: dict[str, Any] = {
    "maxGridSize": [2147483647, 65535, 65535],
    "maxBlockSize": [1024, 1024, 64],
    "regsPerBlock": 65536,
    "warpSize": 32,
    "maxSharedMemoryPerBlock": 49152,
    "maxRegistersPerSM": 65536,
    "maxThreadsPerBlock": 1024,
    "supportCoopLaunch": 1,
}

#: The driver version written into synthesized descriptors (CUDA 13.0, the assumed stack).
ASSUMED_DRIVER_VERSION = 13000


class DescriptorError(ValueError):
    """A descriptor is unknown, malformed, or lacks a field cuDNN requires."""


@cache
def _load_text(name: str) -> str:
    path = resources.files(__package__).joinpath(f"{name}.json")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DescriptorError(
            f"no device descriptor for {name!r}; known: {', '.join(CATALOG_NAMES)}"
        ) from None


def captured_dir() -> Path:
    """Where captured descriptors live (``TE_FL_ATTN_DESCRIPTORS`` or the user data dir); a
    file ``NAME.json`` there replaces the typed catalog descriptor of ``NAME``."""
    env = os.environ.get("TE_FL_ATTN_DESCRIPTORS")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_data_dir("te_fl_attention")) / "descriptors"


def install_captured(name: str, desc: Mapping[str, Any]) -> Path:
    """Store a captured descriptor so it replaces the typed one for catalog GPU ``name``."""
    key = name.strip().lower()
    if key not in CATALOG_NAMES:
        raise DescriptorError(f"no catalog GPU {name!r}; known: {', '.join(CATALOG_NAMES)}")
    validate_descriptor(desc)
    path = captured_dir() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**desc, "_captured": True}, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def load_descriptor(name: str) -> dict[str, Any]:
    """The descriptor of a catalog GPU (``"h100"``): a captured one when installed (see
    :func:`captured_dir`), else the typed file with our ``_sources`` metadata."""
    key = name.strip().lower()
    captured = captured_dir() / f"{key}.json"
    if key in CATALOG_NAMES and captured.is_file():
        desc = json.loads(captured.read_text(encoding="utf-8"))
        validate_descriptor(desc)
        return desc
    if key not in CATALOG_NAMES:
        raise DescriptorError(
            f"no device descriptor for {name!r}; known: {', '.join(CATALOG_NAMES)}"
        )
    desc = json.loads(_load_text(key))
    validate_descriptor(desc)
    return desc


def validate_descriptor(desc: Mapping[str, Any]) -> None:
    """Raise :class:`DescriptorError` unless ``desc`` has every field cuDNN requires, typed."""
    if not isinstance(desc, Mapping):
        raise DescriptorError(f"a device descriptor is a JSON object, got {type(desc).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in desc]
    if missing:
        raise DescriptorError(f"device descriptor lacks field(s) cuDNN requires: {missing}")
    for f in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS):
        if f not in desc:
            continue
        v = desc[f]
        if f in ("maxGridSize", "maxBlockSize"):
            ok = isinstance(v, list) and len(v) == 3 and all(_is_int(x) for x in v)
        elif f == "deviceName":
            ok = isinstance(v, str) and bool(v)
        else:
            ok = _is_int(v)
        if not ok:
            raise DescriptorError(f"device descriptor field {f}={v!r} has the wrong type")
    if desc.get("smCountOrigin", 0) not in (0, 1):
        raise DescriptorError("smCountOrigin must be 0 (full device) or 1 (green context)")
    if desc["deviceVer"] % 10 or desc["deviceVer"] < 100:
        raise DescriptorError(f"deviceVer={desc['deviceVer']} is not compute capability x 100")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def cudnn_json(desc: Mapping[str, Any]) -> str:
    """The JSON text for ``cudnn.create_device_properties``: our ``_`` keys removed, sorted."""
    validate_descriptor(desc)
    return json.dumps({k: v for k, v in desc.items() if not k.startswith("_")}, sort_keys=True)


def descriptor_sm(desc: Mapping[str, Any]) -> int:
    """The ``sm`` (``10 * major + minor``) a descriptor describes (``deviceVer // 10``)."""
    return int(desc["deviceVer"]) // 10


def synthesize_descriptor(
    sm: int, sm_count: int | None, memory_gib: float | None, name: str = "unknown GPU"
) -> dict[str, Any]:
    """A descriptor for a GPU we have no file for: per-CC limits from :data:`CC_LIMITS` (the
    nearest lower compute capability when ``sm`` is not in the table) and placeholders, marked
    in ``_estimated``, for the product facts (clocks, bus width, L2)."""
    known = sorted(k for k in CC_LIMITS if k <= sm)
    if not known:
        raise DescriptorError(f"sm{sm} is older than every compute capability in CC_LIMITS")
    base = known[-1]
    product_estimates = {
        "smClockRateKHz": 1500000,
        "memClockRateKHz": 2000000,
        "memoryBusWidth": 4096 if sm in (80, 90, 100) else 384,
        "l2CacheSize": 50 * 2**20,
    }
    desc: dict[str, Any] = {
        **COMMON_LIMITS,
        **CC_LIMITS[base],
        "multiProcessorCount": int(sm_count) if sm_count else 100,
        "smCountOrigin": 0,
        "oversizedSharedMemoryPerBlock": 0,
        "pciDeviceId": 0,
        "isTccDriver": 0,
        "totalGlobalMem": int((memory_gib or 16.0) * 2**30),
        **product_estimates,
        "cudaDeviceId": 0,
        "deviceVer": int(sm) * 10,
        "driverVer": ASSUMED_DRIVER_VERSION,
        "deviceName": name,
    }
    estimated = list(product_estimates) + ["oversizedSharedMemoryPerBlock"]
    if not sm_count:
        estimated.append("multiProcessorCount")
    if not memory_gib:
        estimated.append("totalGlobalMem")
    if base != sm:
        estimated += list(CC_LIMITS[base])
    desc["_catalog"] = None
    desc["_sources"] = {
        "*": f"synthesized by te_fl_attention from sm={sm}, sm_count={sm_count}, "
        f"memory_gib={memory_gib}; per-CC limits of sm{base} from the CUDA C++ Programming Guide"
    }
    desc["_estimated"] = sorted(set(estimated))
    validate_descriptor(desc)
    return desc


def descriptor_for(device: DeviceProfile, ordinal: int | None = None) -> dict[str, Any]:
    """The descriptor for a :class:`~te_fl_attention.device.DeviceProfile`: the catalog file when
    the profile names a catalog GPU with that file's sm and SM count; for the local GPU, the one
    :func:`capture_local_descriptor` reads from device ``ordinal`` (default: the current one)
    when it matches the profile's sm and SM count; otherwise one synthesized from the profile's
    sm / sm_count / memory (e.g. ``h100:sm=100``, or a local GPU whose capture failed)."""
    if device.sm is None:
        raise DescriptorError(f"{device.name} has no GPU (sm unknown): no device descriptor")
    name = device.name.strip().lower()
    if name in CATALOG_NAMES:
        desc = load_descriptor(name)
        if descriptor_sm(desc) == device.sm and device.sm_count in (
            None,
            desc["multiProcessorCount"],
        ):
            return desc
    why = None
    # A local profile has an sm only with a GPU.
    if device.source == "local":  # gpu-only
        try:
            desc = capture_local_descriptor(ordinal)
        except DescriptorError as exc:
            why = f"capturing the local device failed: {exc}"
        else:
            if descriptor_sm(desc) == device.sm and device.sm_count in (
                None,
                desc["multiProcessorCount"],
            ):
                return desc
            why = (f"the captured device (sm{descriptor_sm(desc)}, "
                   f"{desc['multiProcessorCount']} SMs) is not the profile's")  # fmt: skip
    desc = synthesize_descriptor(device.sm, device.sm_count, device.memory_gib, device.name)
    if why:
        desc["_sources"]["*"] += f" ({why})"
    return desc


#: Descriptors captured in this process, per device ordinal (see :func:`capture_local_descriptor`).
_CAPTURED: dict[int, dict[str, Any]] = {}


def _reset_captured() -> None:
    """Forget the descriptors captured in this process (tests present another GPU)."""
    _CAPTURED.clear()


def current_ordinal() -> int:
    """The CUDA device this process works on: torch's current device when torch is loaded and
    sees a GPU, else 0 (a process narrowed to one device by ``CUDA_VISIBLE_DEVICES``)."""
    from ..workers import current_device

    device = current_device(load_torch=False)
    return 0 if device is None else device


def capture_local_descriptor(ordinal: int | None = None) -> dict[str, Any]:
    """A descriptor filled from local device ``ordinal``'s real attributes (default: the
    current device), cached per ordinal for the process; a copy is returned.

    Reads the ``cuda-bindings`` driver API, falling back to ``torch.cuda.get_device_properties``
    plus :data:`CC_LIMITS` (``_estimated`` then names the fields taken from the table). Raises
    :class:`DescriptorError` without a GPU. Only exercised through the test suite's fake GPU;
    **never ran on a GPU**.
    """
    from ..device import local

    if not local().has_gpu:
        raise DescriptorError("no CUDA GPU on this machine: nothing to capture (use a catalog "
                              "descriptor, e.g. --device h100, for a what-if answer)")  # fmt: skip
    if ordinal is None:  # gpu-only
        ordinal = current_ordinal()
    desc = _CAPTURED.get(ordinal)
    if desc is None:  # gpu-only
        desc = _CAPTURED[ordinal] = capture_device_descriptor(ordinal)
    return json.loads(json.dumps(desc))


def capture_device_descriptor(ordinal: int = 0) -> dict[str, Any]:  # gpu-only
    """:func:`capture_local_descriptor` without its cache and its "is there a GPU" check (the
    probe worker, which imports no torch, asks its own device 0). **Never ran on a GPU.**"""
    import importlib

    bindings_error = "cuda-bindings is not installed"
    try:
        drv = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        drv = None
    if drv is not None:
        try:
            return _capture_with_cuda_bindings(drv, ordinal)
        except Exception as exc:  # noqa: BLE001 - a driver problem: try torch, report both
            bindings_error = f"cuda-bindings: {exc}"
    try:
        return _capture_with_torch(ordinal)
    except DescriptorError as exc:
        raise DescriptorError(f"capturing device {ordinal} failed ({bindings_error}; "
                              f"torch: {exc})") from None  # fmt: skip


def _capture_with_cuda_bindings(drv: Any, ordinal: int) -> dict[str, Any]:  # gpu-only
    """Every field from the driver API (``cuDeviceGetAttribute`` ...). Never ran on a GPU."""

    def check(ret: Any) -> Any:
        err, *rest = ret if isinstance(ret, tuple) else (ret,)
        if int(err) != 0:
            raise DescriptorError(f"CUDA driver call failed with {err!r} (no usable GPU?)")
        return rest[0] if len(rest) == 1 else rest

    check(drv.cuInit(0))
    dev = check(drv.cuDeviceGet(ordinal))
    a = drv.CUdevice_attribute

    def attr(name: str, default: int | None = None) -> int:
        member = getattr(a, "CU_DEVICE_ATTRIBUTE_" + name, None)
        if member is None:
            if default is None:
                raise DescriptorError(f"this cuda-bindings has no attribute {name}")
            return default
        return int(check(drv.cuDeviceGetAttribute(member, dev)))

    major = attr("COMPUTE_CAPABILITY_MAJOR")
    minor = attr("COMPUTE_CAPABILITY_MINOR")
    raw_name = check(drv.cuDeviceGetName(256, dev))
    name = raw_name.split(b"\0", 1)[0].decode() if isinstance(raw_name, bytes) else str(raw_name)
    desc: dict[str, Any] = {
        "maxGridSize": [attr("MAX_GRID_DIM_X"), attr("MAX_GRID_DIM_Y"), attr("MAX_GRID_DIM_Z")],
        "maxBlockSize": [attr("MAX_BLOCK_DIM_X"), attr("MAX_BLOCK_DIM_Y"), attr("MAX_BLOCK_DIM_Z")],
        "regsPerBlock": attr("MAX_REGISTERS_PER_BLOCK"),
        "multiProcessorCount": attr("MULTIPROCESSOR_COUNT"),
        "smCountOrigin": 0,
        "warpSize": attr("WARP_SIZE"),
        "maxSharedMemoryPerBlock": attr("MAX_SHARED_MEMORY_PER_BLOCK"),
        "maxSharedMemoryPerBlockOptin": attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        "reservedSharedMemoryPerBlock": attr("RESERVED_SHARED_MEMORY_PER_BLOCK", 0),
        "oversizedSharedMemoryPerBlock": 0,
        "maxRegistersPerSM": attr("MAX_REGISTERS_PER_MULTIPROCESSOR"),
        "maxCtasPerSM": attr("MAX_BLOCKS_PER_MULTIPROCESSOR"),
        "maxThreadsPerBlock": attr("MAX_THREADS_PER_BLOCK"),
        "maxThreadsPerSM": attr("MAX_THREADS_PER_MULTIPROCESSOR"),
        "pciDeviceId": attr("PCI_DEVICE_ID"),
        "isTccDriver": attr("TCC_DRIVER", 0),
        "supportCoopLaunch": attr("COOPERATIVE_LAUNCH", 1),
        "totalGlobalMem": int(check(drv.cuDeviceTotalMem(dev))),
        "smClockRateKHz": attr("CLOCK_RATE", 0),
        "memClockRateKHz": attr("MEMORY_CLOCK_RATE", 0),
        "memoryBusWidth": attr("GLOBAL_MEMORY_BUS_WIDTH"),
        "l2CacheSize": attr("L2_CACHE_SIZE"),
        "cudaDeviceId": ordinal,
        "deviceVer": major * 100 + minor * 10,
        "driverVer": int(check(drv.cuDriverGetVersion())),
        "deviceName": name,
        "_catalog": None,
        "_captured": "cuda-bindings",
        "_sources": {"*": f"captured from device {ordinal} with cuda-bindings"},
        "_estimated": ["oversizedSharedMemoryPerBlock"],
    }
    validate_descriptor(desc)
    return desc


#: ``torch.cuda.get_device_properties`` attribute -> descriptor field (torch >= 2.7 has them all).
_TORCH_PROPS = (
    ("l2CacheSize", "L2_cache_size"),
    ("warpSize", "warp_size"),
    ("maxThreadsPerSM", "max_threads_per_multi_processor"),
    ("maxThreadsPerBlock", "max_threads_per_block"),
    ("maxRegistersPerSM", "regs_per_multiprocessor"),
    ("maxSharedMemoryPerBlockOptin", "shared_memory_per_block_optin"),
    ("maxSharedMemoryPerBlock", "shared_memory_per_block"),
    ("smClockRateKHz", "clock_rate"),
    ("memClockRateKHz", "memory_clock_rate"),
    ("memoryBusWidth", "memory_bus_width"),
    ("pciDeviceId", "pci_device_id"),
)


def _capture_with_torch(ordinal: int) -> dict[str, Any]:  # gpu-only
    """What torch's device properties say, the rest from :data:`CC_LIMITS` (marked estimated).
    Never ran on a GPU."""
    try:
        import torch
    except ImportError:
        raise DescriptorError("torch is not installed") from None
    if not torch.cuda.is_available():
        raise DescriptorError("torch sees no CUDA GPU: nothing to capture")
    p = torch.cuda.get_device_properties(ordinal)
    sm = p.major * 10 + p.minor
    desc = synthesize_descriptor(sm, p.multi_processor_count, p.total_memory / 2**30, p.name)
    desc["totalGlobalMem"] = int(p.total_memory)
    desc["cudaDeviceId"] = ordinal
    estimated = set(desc["_estimated"]) - {"multiProcessorCount", "totalGlobalMem"}
    for ours, theirs in _TORCH_PROPS:
        value = getattr(p, theirs, None)
        if isinstance(value, int) and not isinstance(value, bool):
            desc[ours] = value
            estimated.discard(ours)
    driver = _driver_version(torch)
    if driver is not None:
        desc["driverVer"] = driver
    else:
        estimated.add("driverVer")
    desc["_captured"] = "torch"
    desc["_sources"] = {"*": f"captured from device {ordinal} with torch (rest: per-CC table)"}
    desc["_estimated"] = sorted(estimated | {"maxCtasPerSM", "reservedSharedMemoryPerBlock"})
    validate_descriptor(desc)
    return desc


def _driver_version(torch: Any) -> int | None:
    """``cuDriverGetVersion`` as torch reports it (CUDA builds of torch only; else ``None``)."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is None:
        return None
    try:
        return int(get())
    except (RuntimeError, TypeError, ValueError):
        return None


__all__ = [
    "ASSUMED_DRIVER_VERSION",
    "CATALOG_NAMES",
    "CC_LIMITS",
    "COMMON_LIMITS",
    "DescriptorError",
    "OPTIONAL_FIELDS",
    "REQUIRED_FIELDS",
    "capture_device_descriptor",
    "capture_local_descriptor",
    "current_ordinal",
    "cudnn_json",
    "descriptor_for",
    "descriptor_sm",
    "load_descriptor",
    "synthesize_descriptor",
    "validate_descriptor",
]
