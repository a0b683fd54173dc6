"""The hardware seam: a GPU presented to the code through the calls the code itself makes.

A :class:`FakeGPU` replaces, for one test (or one child process), exactly the calls that need an
NVIDIA GPU and nothing above them:

* device queries: NVML (``pynvml``), ``torch.cuda.is_available / device_count / current_device /
  set_device / get_device_properties / get_device_capability / get_device_name``,
  ``torch.version.cuda``, ``torch.backends.cudnn.is_available / version``,
  ``torch._C._cuda_getDriverVersion``, and the driver API that
  :func:`te_fl_attention.descriptors.capture_local_descriptor` reads (``cuda.bindings.driver``:
  ``cuInit``, ``cuDeviceGet``, ``cuDeviceGetAttribute``, ``cuDeviceGetName``, ``cuDeviceTotalMem``,
  ``cuDriverGetVersion``), all answered from the catalog descriptor of the GPU being presented
  (``h100``, ``b200``), so a descriptor captured from the fake equals the typed one;
* stream and timing calls: ``torch.cuda.synchronize`` (counted; it can be armed to raise the
  asynchronous fault of a kernel that ran before it), ``torch.cuda.Event`` (host clock),
  ``torch.cuda.empty_cache``, ``torch.cuda.device(...)`` (records the device entered),
  ``torch.cuda.is_current_stream_capturing``;
* tensor placement: :func:`te_fl_attention.kernels.run.tensor_device`, the one place that names
  the CUDA device tensors go to, answers ``cpu`` (a CPU build of torch cannot allocate on CUDA);
* kernel launches and handles, opt-in: :func:`fake_cudnn_handle` (``cudnn.create_handle`` and the
  ``backend_graph(handle=...)`` constructor that consumes it: the fake handle resolves to the
  presented device's properties, so cuDNN plans for real, deviceless), and :data:`FLASH_SITE`, a
  site directory holding an installed ``flash-attn 2.8.3`` whose kernels check their inputs the way
  flash-attn's ``flash_api.cpp`` does and compute with the reference.

Child processes get the same fake through :meth:`FakeGPU.child_env` (``sitecustomize`` in
:data:`SITE` installs it at interpreter start from ``TE_FL_TEST_FAKE_GPU``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: ``sitecustomize`` that installs the fake in a child process (put it on ``PYTHONPATH``).
SITE = HERE / "site"
#: A site directory with the fake flash-attn 2.8.3 installation (package + dist-info).
FLASH_SITE = HERE / "flashpkg"
ROOT = HERE.parents[1]

ENV = "TE_FL_TEST_FAKE_GPU"  # "h100" or "b200", optionally ":ordinal=3,count=8"
FAULT_ENV = "TE_FL_TEST_FAKE_GPU_FAULT"  # arm synchronize with a fault: "illegal_address"

#: The fault a kernel with an out-of-bounds access leaves for the next synchronizing call.
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def descriptor(name: str) -> dict[str, Any]:
    """The catalog descriptor the fake answers from (the same file deviceless planning reads)."""
    from te_fl_attention.descriptors import load_descriptor

    return {k: v for k, v in load_descriptor(name).items() if not k.startswith("_")}


class FakeProps(types.SimpleNamespace):
    """What ``torch.cuda.get_device_properties`` returns (torch's ``_CudaDeviceProperties``)."""


def _props(desc: dict[str, Any], ordinal: int) -> FakeProps:
    ver = desc["deviceVer"]
    return FakeProps(
        name=desc["deviceName"], major=ver // 100, minor=(ver // 10) % 10,
        total_memory=desc["totalGlobalMem"], multi_processor_count=desc["multiProcessorCount"],
        warp_size=desc["warpSize"], max_threads_per_multi_processor=desc["maxThreadsPerSM"],
        max_threads_per_block=desc["maxThreadsPerBlock"],
        regs_per_multiprocessor=desc["maxRegistersPerSM"],
        shared_memory_per_block=desc["maxSharedMemoryPerBlock"],
        shared_memory_per_block_optin=desc["maxSharedMemoryPerBlockOptin"],
        shared_memory_per_multiprocessor=desc["maxSharedMemoryPerBlockOptin"] + 1024,
        L2_cache_size=desc["l2CacheSize"], clock_rate=desc["smClockRateKHz"],
        memory_clock_rate=desc["memClockRateKHz"], memory_bus_width=desc["memoryBusWidth"],
        is_integrated=0, is_multi_gpu_board=0, uuid=f"GPU-fake-{ordinal:04d}",
        pci_bus_id=ordinal, pci_device_id=desc["pciDeviceId"], pci_domain_id=0,
    )  # fmt: skip


#: driver attribute -> descriptor field (index for the 3-vectors).
_ATTRS: dict[str, tuple[str, int | None]] = {
    "MAX_GRID_DIM_X": ("maxGridSize", 0), "MAX_GRID_DIM_Y": ("maxGridSize", 1),
    "MAX_GRID_DIM_Z": ("maxGridSize", 2), "MAX_BLOCK_DIM_X": ("maxBlockSize", 0),
    "MAX_BLOCK_DIM_Y": ("maxBlockSize", 1), "MAX_BLOCK_DIM_Z": ("maxBlockSize", 2),
    "MAX_REGISTERS_PER_BLOCK": ("regsPerBlock", None),
    "MULTIPROCESSOR_COUNT": ("multiProcessorCount", None), "WARP_SIZE": ("warpSize", None),
    "MAX_SHARED_MEMORY_PER_BLOCK": ("maxSharedMemoryPerBlock", None),
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": ("maxSharedMemoryPerBlockOptin", None),
    "RESERVED_SHARED_MEMORY_PER_BLOCK": ("reservedSharedMemoryPerBlock", None),
    "MAX_REGISTERS_PER_MULTIPROCESSOR": ("maxRegistersPerSM", None),
    "MAX_BLOCKS_PER_MULTIPROCESSOR": ("maxCtasPerSM", None),
    "MAX_THREADS_PER_BLOCK": ("maxThreadsPerBlock", None),
    "MAX_THREADS_PER_MULTIPROCESSOR": ("maxThreadsPerSM", None),
    "PCI_DEVICE_ID": ("pciDeviceId", None), "TCC_DRIVER": ("isTccDriver", None),
    "COOPERATIVE_LAUNCH": ("supportCoopLaunch", None), "CLOCK_RATE": ("smClockRateKHz", None),
    "MEMORY_CLOCK_RATE": ("memClockRateKHz", None),
    "GLOBAL_MEMORY_BUS_WIDTH": ("memoryBusWidth", None), "L2_CACHE_SIZE": ("l2CacheSize", None),
}  # fmt: skip


class FakeEvent:
    """``torch.cuda.Event``: records the host clock (the fake's kernels run synchronously)."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.t is None or end.t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end.t - self.t) * 1e3


class FakeGPU:
    """One presented GPU model, ``count`` of them, the current one ``ordinal``."""

    def __init__(self, name: str = "h100", ordinal: int = 0, count: int = 1) -> None:
        self.name = name
        self.desc = descriptor(name)
        self.ordinal = ordinal
        self.count = max(count, ordinal + 1)
        self.sm = self.desc["deviceVer"] // 10
        self.synchronize_calls = 0
        self.devices_entered: list[Any] = []
        self.capturing = False
        #: Raised by the next synchronizing call (an asynchronous kernel fault), then cleared.
        self.pending_fault: str | None = None

    # ------------------------------------------------------------------ the replaced calls
    def props(self, device: Any = None) -> FakeProps:
        return _props(self.desc, self._index(device))

    def _index(self, device: Any) -> int:
        if device is None:
            return self.ordinal
        if isinstance(device, int):
            index = device
        else:
            index = getattr(device, "index", None)
            if index is None and isinstance(device, str):
                index = int(device.split(":")[1]) if ":" in device else self.ordinal
            index = self.ordinal if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def set_device(self, device: Any) -> None:
        self.ordinal = self._index(device)

    def synchronize(self, device: Any = None) -> None:
        self.synchronize_calls += 1
        if self.pending_fault:
            fault, self.pending_fault = self.pending_fault, None
            raise RuntimeError(fault)

    @contextlib.contextmanager
    def device_ctx(self, device: Any) -> Iterator[None]:
        self.devices_entered.append(device)
        yield

    # ------------------------------------------------------------------ cuda.bindings.driver
    def driver_module(self, real: Any) -> types.SimpleNamespace:
        """A stand-in for ``cuda.bindings.driver``: real enums, answers from the descriptor."""
        ok, bad = real.CUresult.CUDA_SUCCESS, real.CUresult.CUDA_ERROR_INVALID_VALUE
        by_member = {getattr(real.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + n): spec
                     for n, spec in _ATTRS.items()}  # fmt: skip
        ver = self.desc["deviceVer"]
        by_member[real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR] = (
            "_major", None)  # fmt: skip
        by_member[real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR] = (
            "_minor", None)  # fmt: skip
        values = {**self.desc, "_major": ver // 100, "_minor": (ver // 10) % 10}

        def attr(member: Any, dev: Any) -> tuple[Any, int]:
            spec = by_member.get(member)
            if spec is None or not 0 <= int(dev) < self.count:
                return bad, 0
            field, index = spec
            v = values[field]
            return ok, int(v[index] if index is not None else v)

        def name(length: int, dev: Any) -> tuple[Any, bytes]:
            return ok, self.desc["deviceName"].encode().ljust(length, b"\0")[:length]

        def device_get(ordinal: int) -> tuple[Any, Any]:
            return (ok, real.CUdevice(ordinal)) if 0 <= ordinal < self.count else (bad, None)

        return types.SimpleNamespace(
            CUresult=real.CUresult, CUdevice_attribute=real.CUdevice_attribute,
            CUdevice=real.CUdevice, cuInit=lambda flags: (ok,), cuDeviceGet=device_get,
            cuDeviceGetAttribute=attr, cuDeviceGetName=name,
            cuDeviceTotalMem=lambda dev: (ok, self.desc["totalGlobalMem"]),
            cuDriverGetVersion=lambda: (ok, self.desc["driverVer"]),
            cuDeviceGetCount=lambda: (ok, self.count),
        )  # fmt: skip

    def nvml_module(self) -> types.ModuleType:
        """A stand-in for ``pynvml`` (NVML's Python binding): the device queries ``local()``
        makes, answered from the descriptor."""
        nvml = types.ModuleType("pynvml")
        ver = self.desc["deviceVer"]
        nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
        nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
        nvml.nvmlDeviceGetCount = lambda: self.count  # type: ignore[attr-defined]
        nvml.nvmlDeviceGetHandleByIndex = lambda i: ("nvml-handle", i)  # type: ignore[attr-defined]
        nvml.nvmlDeviceGetCudaComputeCapability = (  # type: ignore[attr-defined]
            lambda h: (ver // 100, (ver // 10) % 10))
        nvml.nvmlDeviceGetName = lambda h: self.desc["deviceName"]  # type: ignore[attr-defined]
        nvml.nvmlSystemGetDriverVersion = lambda: "580.95.05"  # type: ignore[attr-defined]
        nvml.nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
            lambda h: types.SimpleNamespace(total=self.desc["totalGlobalMem"]))
        return nvml

    # ------------------------------------------------------------------ installing
    def patches(self) -> list[tuple[Any, str, Any]]:
        """(object, attribute, replacement) for every replaced call."""
        import torch

        from te_fl_attention.kernels import run as runner

        cudnn_version = 92801
        out: list[tuple[Any, str, Any]] = [
            (torch.cuda, "is_available", lambda: True),
            (torch.cuda, "device_count", lambda: self.count),
            (torch.cuda, "current_device", lambda: self.ordinal),
            (torch.cuda, "set_device", self.set_device),
            (torch.cuda, "get_device_properties", self.props),
            (torch.cuda, "get_device_capability",
             lambda device=None: (self.props(device).major, self.props(device).minor)),
            (torch.cuda, "get_device_name", lambda device=None: self.props(device).name),
            (torch.cuda, "synchronize", self.synchronize),
            (torch.cuda, "Event", FakeEvent),
            (torch.cuda, "empty_cache", lambda: None),
            (torch.cuda, "device", self.device_ctx),
            (torch.cuda, "is_current_stream_capturing", lambda: self.capturing),
            (torch.version, "cuda", "13.0"),
            (torch.backends.cudnn, "is_available", lambda: True),
            (torch.backends.cudnn, "version", lambda: cudnn_version),
            (torch._C, "_cuda_getDriverVersion", lambda: self.desc["driverVer"]),
            (runner, "tensor_device", lambda: "cpu"),
        ]  # fmt: skip
        try:
            real = importlib.import_module("cuda.bindings.driver")
        except ImportError:
            pass
        else:
            bindings = sys.modules["cuda.bindings"]
            out.append((bindings, "driver", self.driver_module(real)))
        return out

    def install(self, monkeypatch: Any) -> FakeGPU:
        """Install for one test (``monkeypatch`` undoes it)."""
        for obj, attr, value in self.patches():
            monkeypatch.setattr(obj, attr, value, raising=False)  # CPU torch lacks some
        fake_driver = getattr(sys.modules.get("cuda.bindings"), "driver", None)
        if fake_driver is not None:
            monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_driver)
        monkeypatch.setitem(sys.modules, "pynvml", self.nvml_module())
        reset_process_state()
        return self

    def install_forever(self) -> FakeGPU:
        """Install for the rest of this process (child processes, via ``sitecustomize``)."""
        for obj, attr, value in self.patches():
            setattr(obj, attr, value)
        fake_driver = getattr(sys.modules.get("cuda.bindings"), "driver", None)
        if fake_driver is not None:
            sys.modules["cuda.bindings.driver"] = fake_driver
        sys.modules["pynvml"] = self.nvml_module()
        fault = os.environ.get(FAULT_ENV)
        if fault == "illegal_address":
            self.pending_fault = ILLEGAL_ADDRESS
        return self

    def child_env(self, base: dict[str, str] | None = None, *, flash: bool = False,
                  fault: str | None = None) -> dict[str, str]:  # fmt: skip
        """The environment of a child process that sees this GPU (and, with ``flash``, the
        fake flash-attn installation)."""
        env = dict(os.environ if base is None else base)
        paths = [str(SITE), *([str(FLASH_SITE)] if flash else []), str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        env[ENV] = f"{self.name}:ordinal={self.ordinal},count={self.count}"
        if fault:
            env[FAULT_ENV] = fault
        else:
            env.pop(FAULT_ENV, None)
        return env


def parse_env(value: str) -> FakeGPU:
    name, _, rest = value.partition(":")
    kw = dict(item.split("=", 1) for item in rest.split(",") if item)
    return FakeGPU(name, ordinal=int(kw.get("ordinal", 0)), count=int(kw.get("count", 1)))


def install_from_env() -> FakeGPU | None:
    """``sitecustomize``'s entry: install the GPU ``TE_FL_TEST_FAKE_GPU`` names."""
    value = os.environ.get(ENV)
    if not value:
        return None
    gpu = parse_env(value).install_forever()
    sys.modules["te_fl_fake_gpu_installed"] = types.ModuleType("te_fl_fake_gpu_installed")
    sys.modules["te_fl_fake_gpu_installed"].gpu = gpu  # type: ignore[attr-defined]
    return gpu


def reset_process_state() -> None:
    """Forget what this process learnt about its device (the local profile, the default
    selector, captured descriptors) so the next question sees the presented GPU."""
    from te_fl_attention import device, selector

    device.local.cache_clear()
    selector._DEFAULT = None
    descriptors = sys.modules.get("te_fl_attention.descriptors")
    clear = getattr(descriptors, "_reset_captured", None)
    if clear is not None:
        clear()


# ------------------------------------------------------------------------------ cuDNN's handle
FAKE_BACKEND_HANDLE = 0xFA4E


def fake_cudnn_handle(monkeypatch: Any, gpu: FakeGPU) -> dict[str, Any]:
    """Replace cuDNN's handle creation and the graph constructor that consumes a handle.

    ``cudnn.create_handle()`` returns a real ``cudnn.Handle`` around a fake backend handle bound
    to ``gpu``'s current device; ``backend_graph(handle=<int>)`` then plans for that device with
    its descriptor (deviceless), and refuses anything but a raw int handle exactly as the
    compiled binding does. Returns a record of what was called."""
    import cudnn

    calls: dict[str, Any] = {"create_handle": 0, "graphs": [], "ordinals": []}
    real_graph = cudnn._pybind_module.backend_graph
    from te_fl_attention.descriptors import cudnn_json

    def create_handle() -> Any:
        calls["create_handle"] += 1
        calls["ordinals"].append(gpu.ordinal)
        return cudnn.Handle(FAKE_BACKEND_HANDLE + gpu.ordinal, gpu.ordinal, 0)

    def backend_graph(**kw: Any) -> Any:
        handle = kw.pop("handle", None)
        if handle is not None and (not isinstance(handle, int) or isinstance(handle, bool)):
            raise TypeError(
                "__init__(): incompatible constructor arguments. The following argument types "
                f"are supported: ... handle: int | None = None ... Invoked with: {handle!r}"
            )
        calls["graphs"].append(handle)
        if handle is not None:
            kw.setdefault("device_property", cudnn.create_device_properties(cudnn_json(gpu.desc)))
            kw.setdefault("sm_version", gpu.sm)
        return real_graph(**kw)

    monkeypatch.setattr(cudnn, "create_handle", create_handle)
    monkeypatch.setattr(cudnn._pybind_module, "backend_graph", backend_graph)
    return calls


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path
