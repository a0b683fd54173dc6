"""The stub NVIDIA driver that makes cuDNN's deviceless planning reachable on a machine without one.

cuDNN's runtime-compiled engine library links ``libcuda.so.1``. Without a driver cuDNN cannot load
it and declines every SDPA graph before looking at it. :func:`setup_driver` fixes that, in this
order:

1. :func:`real_driver_status` looks for a real driver (``ctypes.CDLL("libcuda.so.1")`` and
   ``cuInit(0)`` / ``cuDeviceGetCount``). If one is loadable, the stub is **never** built or loaded:
   a stub would shadow the real driver for the rest of the process.
2. Otherwise :func:`build_stub` compiles ``stubcuda.c`` (package data) once with the system C
   compiler into ``<user cache>/stubcuda/<sha256 of the source>/libcuda.so.1``, and
   :func:`load_stub` loads it with ``RTLD_GLOBAL``. Its soname is ``libcuda.so.1``, so when cuDNN
   later opens its engine library (which links ``libcuda.so.1``), the loader reuses the stub.

The stub's directories are created ``0700`` and the library ``0600`` whatever the umask, with its
sha256 recorded next to it (``libcuda.so.1.sha256``). A library already there is reused only
when it and its directories are owned by this user and not writable by others, and its content
matches the recorded hash (:func:`reuse_problem`); otherwise it is rebuilt.

The stub is loaded by absolute path only; it is never put on ``LD_LIBRARY_PATH`` and never touches
other processes. Call :func:`setup_driver` before ``import cudnn``, in the process that will plan
(the probe worker, :mod:`te_fl_attention.probes.fused.worker`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

#: The library name the stub impersonates (its soname).
SONAME = "libcuda.so.1"

#: Compiler flags: a position-independent shared object whose soname is libcuda.so.1.
CFLAGS = ("-shared", "-fPIC", "-O2", "-Wl,-soname," + SONAME)

_lock = threading.Lock()
_state: DriverSetup | None = None


@dataclass(frozen=True)
class DriverStatus:
    """What :func:`real_driver_status` found. ``loadable``: a real libcuda.so.1 loads."""

    loadable: bool
    device_count: int = 0
    detail: str = ""


@dataclass(frozen=True)
class DriverSetup:
    """The outcome of :func:`setup_driver`.

    ``mode``: ``"real"`` (a real driver with at least one GPU), ``"real-nodevice"`` (a real driver
    that reports no GPU; cuDNN plans deviceless against it), ``"stub"`` (the stub is loaded) or
    ``"unavailable"`` (no driver and no stub; ``error`` says why).
    """

    mode: str
    path: str | None = None
    device_count: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.mode != "unavailable"


def real_driver_status() -> DriverStatus:
    """Is a real NVIDIA driver loadable here, and how many GPUs does it report?

    Loads ``libcuda.so.1`` through the normal loader search (no stub is on that path: the stub is
    only ever loaded by absolute path). Tests replace this function with a double.
    """
    try:
        lib = ctypes.CDLL(SONAME)
    except OSError as exc:
        return DriverStatus(False, 0, str(exc))
    if getattr(lib, "te_fl_attention_stub", None) is not None:  # pragma: no cover - defensive
        return DriverStatus(False, 0, "the te_fl_attention stub, not a real driver")
    try:
        init = lib.cuInit(0)
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count)) if init == 0 else init
    except (AttributeError, OSError) as exc:  # pragma: no cover - a broken driver install
        return DriverStatus(True, 0, f"libcuda.so.1 loads but cuInit failed: {exc}")
    if rc != 0:
        return DriverStatus(True, 0, f"libcuda.so.1 loads; cuInit/cuDeviceGetCount returned {rc}")
    return DriverStatus(True, int(count.value), f"{count.value} device(s)")


def stub_source() -> bytes:
    """The C source of the stub (package data ``stubcuda.c``)."""
    return resources.files(__package__).joinpath("stubcuda.c").read_bytes()


def cache_root() -> Path:
    """``<user cache dir>/stubcuda`` (``TE_FL_ATTENTION_STUB_DIR`` overrides it, for tests)."""
    override = os.environ.get("TE_FL_ATTENTION_STUB_DIR")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("te_fl_attention")) / "stubcuda"


def stub_path() -> Path:
    """Where the stub for the current source lives (built or not)."""
    digest = hashlib.sha256(stub_source() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return cache_root() / digest / SONAME


def find_compiler() -> str | None:
    """``$CC`` if set, else the first of cc, gcc, clang on ``PATH``."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class StubBuildError(RuntimeError):
    """The stub could not be built (no compiler, or the compiler failed)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hash_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def reuse_problem(target: Path) -> str | None:
    """Why an existing stub at ``target`` must not be loaded (``None``: it may be). Checks the
    library, its hash file and its two directories: owned by this user, not writable by group or
    others (the library and hash file: ``0600``), and the library's sha256 as recorded."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for path, private in ((target, True), (_hash_path(target), True),
                          (target.parent, False), (target.parent.parent, False)):  # fmt: skip
        try:
            st = os.lstat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if uid is not None and st.st_uid != uid:
            return f"{path} is owned by uid {st.st_uid}, not {uid}"
        if st.st_mode & (0o077 if private else 0o022):
            return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}"
    try:
        recorded = _hash_path(target).read_text().strip()
        actual = _sha256(target)
    except OSError as exc:
        return f"cannot check {target}: {exc.strerror or exc}"
    if recorded != actual:
        return f"{target} does not match its recorded sha256"
    return None


def build_stub() -> Path:
    """Compile the stub once; return its path. Concurrent builders race safely (atomic rename).

    An existing stub is reused only when :func:`reuse_problem` finds nothing wrong; otherwise it
    is rebuilt in place."""
    from ...files import make_private_dirs

    target = stub_path()
    if target.is_file() and reuse_problem(target) is None:
        return target
    cc = find_compiler()
    if cc is None:
        raise StubBuildError(
            "no C compiler found (tried $CC, cc, gcc, clang): the stub libcuda.so.1 that cuDNN "
            "needs for deviceless planning cannot be built; install gcc or set CC"
        )
    make_private_dirs(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "stubcuda.c"
        src.write_bytes(stub_source())
        out = Path(tmp) / SONAME
        cmd = [cc, *CFLAGS, "-o", str(out), str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StubBuildError(f"compiling the stub driver failed: {exc}") from None
        if proc.returncode != 0 or not out.is_file():
            raise StubBuildError(
                f"compiling the stub driver failed ({' '.join(cmd)}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        os.chmod(out, 0o600)  # loadable by its owner; mmap needs no execute bit
        digest = Path(tmp) / "sha256"
        digest.write_text(_sha256(out) + "\n")
        os.chmod(digest, 0o600)
        os.replace(out, target)
        os.replace(digest, _hash_path(target))
    problem = reuse_problem(target)
    if problem is not None:  # e.g. a directory made by someone else, or a concurrent rebuild
        raise StubBuildError(f"the stub driver cannot be trusted: {problem}")
    return target


def load_stub(path: Path) -> ctypes.CDLL:
    """Load the stub globally so that cuDNN's later ``dlopen("libcuda.so.1")`` finds it."""
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def setup_driver() -> DriverSetup:
    """Make cuDNN's engine library loadable in this process; idempotent. See the module doc."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        status = real_driver_status()
        if status.loadable:
            mode = "real" if status.device_count > 0 else "real-nodevice"
            _state = DriverSetup(mode, SONAME, status.device_count)
            return _state
        try:
            path = build_stub()
            load_stub(path)
        except (StubBuildError, OSError) as exc:
            _state = DriverSetup("unavailable", None, 0, str(exc))
            return _state
        _state = DriverSetup("stub", str(path), 0)
        return _state


def current_setup() -> DriverSetup | None:
    """The result of :func:`setup_driver` in this process, or ``None`` if it has not run."""
    return _state


def _reset_for_tests() -> None:
    """Forget the recorded setup (a loaded library stays loaded; tests use fresh processes)."""
    global _state
    with _lock:
        _state = None


__all__ = [
    "DriverSetup",
    "DriverStatus",
    "StubBuildError",
    "build_stub",
    "cache_root",
    "current_setup",
    "find_compiler",
    "load_stub",
    "real_driver_status",
    "reuse_problem",
    "setup_driver",
    "stub_path",
    "stub_source",
]
