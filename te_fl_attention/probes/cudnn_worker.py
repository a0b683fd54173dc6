"""Crash isolation for cuDNN probes: a long-lived worker subprocess, JSON lines over pipes.

cuDNN can abort the process it runs in (a missing cuBLAS is a ``SIGABRT``; a bad graph may be
worse), and the deviceless setup loads a stub ``libcuda.so.1`` that must never end up in the
caller's process. So probes run in a worker process that:

* is spawned lazily on the first probe and reused for the next ones (its import of cuDNN and its
  device-property cache make every later probe ~1-10 ms);
* sets up the driver (:func:`._stubcuda.setup_driver`: the stub only when no real driver is
  loadable), imports cudnn, and answers ``{"op": "probe", ...}`` requests with
  :func:`.cudnn_graph.probe_config` results;
* keeps the protocol on a private copy of its stdout: its fd 1 is pointed at fd 2, so whatever
  C++ prints cannot corrupt a reply; its stderr goes to a temporary file, whose tail explains a
  death ("Invalid handle. Cannot load symbol ...").

A probe that crashes the worker, or runs past its timeout (the worker is then killed), becomes a
result ``{"supported": False, "decided": False, "step": "worker", "code": "cudnn.worker_died" |
"cudnn.worker_timeout", "message": "probe worker died (signal 6, SIGABRT) ..."}``; the next probe
starts a new worker transparently. A worker found dead between probes is replaced, and the probe
that notices it says so in its ``notes``.

On a machine with a GPU the worker sees the real driver (the stub is never loaded there).
``probe(..., use_real_gpu=True)`` then plans with a real cuDNN handle on the local GPU instead of a
descriptor; that path **never ran on a GPU** (none was available while writing it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Seconds a new worker may take to start (stub compile + cudnn import; ~1 s warm, more cold).
START_TIMEOUT_S = 120.0

#: Bytes of the worker's stderr quoted in a death report.
STDERR_TAIL = 1500

_STDERR_LIMIT = 1 << 20  # the worker truncates its stderr file past 1 MiB


def _worker_result(code: str, message: str, **kw: Any) -> dict[str, Any]:
    from .cudnn_graph import _result

    return _result(
        supported=False,
        decided=False,
        code=code,
        step="worker",
        message=message,
        summary=message.splitlines()[0] if message else message,
        **kw,
    )


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is unresponsive"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"died (signal {-returncode}, {name})"
    return f"exited with status {returncode}"


class CudnnWorker:
    """One probe worker process (spawned on first use, respawned after a death).

    Thread-safe: probes are serialized. ``close()`` ends the worker; the object stays usable
    (the next probe spawns a new one).
    """

    def __init__(
        self, *, start_timeout_s: float = START_TIMEOUT_S, env: Mapping[str, str] | None = None
    ) -> None:
        self.start_timeout_s = start_timeout_s
        self._env = dict(env) if env is not None else None
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr_path: str | None = None
        self._buf = b""
        self._next_id = 0
        self.hello: dict[str, Any] | None = None
        #: Number of workers started so far (a test and benchmark aid).
        self.starts = 0

    # ------------------------------------------------------------------ process management
    @property
    def pid(self) -> int | None:
        """The current worker's pid, or ``None`` when none is running."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _spawn(self) -> None:
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ if self._env is None else self._env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        fd, path = tempfile.mkstemp(prefix="te-fl-cudnn-worker-", suffix=".stderr")
        os.close(fd)
        self._stderr_path = path
        # Read+append: the worker scans it (pread) and may truncate it safely (O_APPEND).
        with open(path, "a+b") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "te_fl_attention.probes.cudnn_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                bufsize=0,
                close_fds=True,
            )
        self._buf = b""
        self.starts += 1
        try:
            line = self._read_line(self.start_timeout_s)
        except TimeoutError:
            self._kill()
            raise RuntimeError(
                f"the cuDNN probe worker did not start within {self.start_timeout_s:.0f} s"
            ) from None
        if line is None:
            rc = self._reap()
            tail = self._stderr_tail()
            self._discard()
            raise RuntimeError(
                f"the cuDNN probe worker {_describe_exit(rc)} while starting"
                + (f"; stderr: {tail}" if tail else "")
            )
        self.hello = json.loads(line).get("hello")

    def _ensure(self) -> list[str]:
        """A live worker; returns notes about a predecessor found dead."""
        notes: list[str] = []
        if self._proc is not None and self._proc.poll() is not None:
            old_pid, rc = self._proc.pid, self._proc.returncode
            tail = self._stderr_tail()
            notes.append(
                f"the previous probe worker (pid {old_pid}) had {_describe_exit(rc)} while idle; "
                "a new worker was started" + (f" (its stderr: {tail})" if tail else "")
            )
            self._discard()
        if self._proc is None:
            self._spawn()
        return notes

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _reap(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
            return proc.returncode

    def _discard(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._stderr_path:
            with contextlib.suppress(OSError):
                os.unlink(self._stderr_path)
        self._stderr_path = None
        self._buf = b""

    def _stderr_tail(self) -> str:
        if not self._stderr_path:
            return ""
        try:
            with open(self._stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - STDERR_TAIL))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the worker (politely, then by force)."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    assert proc.stdin is not None
                    proc.stdin.write(b'{"op": "exit"}\n')
                    proc.stdin.flush()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._discard()

    def __enter__(self) -> CudnnWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def _read_line(self, timeout_s: float) -> bytes | None:
        """One reply line; ``None`` on EOF (the worker died); TimeoutError past the deadline."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def request(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its reply (a worker-failure result on death/timeout)."""
        with self._lock:
            try:
                notes = self._ensure()
            except RuntimeError as exc:
                return _worker_result("cudnn.worker_died", str(exc))
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            self._next_id += 1
            payload = {**payload, "id": self._next_id}
            pid = proc.pid
            try:
                proc.stdin.write((json.dumps(payload) + "\n").encode())
                proc.stdin.flush()
                line = self._read_line(timeout_s)
            except TimeoutError:
                self._kill()
                tail = self._stderr_tail()
                self._discard()
                return _worker_result(
                    "cudnn.worker_timeout",
                    f"probe worker (pid {pid}) timed out after {timeout_s:g} s and was killed; "
                    "the next probe starts a new worker" + (f"\nstderr: {tail}" if tail else ""),
                    notes=notes,
                )
            except (BrokenPipeError, OSError):
                line = None
            if line is None:
                rc = self._reap()
                tail = self._stderr_tail()
                self._discard()
                return _worker_result(
                    "cudnn.worker_died",
                    f"probe worker (pid {pid}) {_describe_exit(rc)} during the probe; the next "
                    "probe starts a new worker" + (f"\nstderr: {tail}" if tail else ""),
                    notes=notes,
                )
            reply = json.loads(line)
            result = reply.get("result", reply)
            if notes and isinstance(result, dict):
                result["notes"] = notes + list(result.get("notes") or [])
            return result

    def probe(
        self,
        config_dict: Mapping[str, Any],
        device_descriptor: str | Mapping[str, Any],
        sm: int | None = None,
        timeout_s: float = 30.0,
        *,
        build_plans: bool = False,
        heuristics: tuple[str, ...] | None = None,
        use_real_gpu: bool = False,
    ) -> dict[str, Any]:
        """:func:`.cudnn_graph.probe_config` in the worker; see the module doc for failures.

        ``device_descriptor``: a descriptor dict or a catalog name (resolved here, so a bad
        name fails fast without a worker). ``use_real_gpu``: plan on the local GPU with a real
        handle (only where the worker found a real driver with a GPU; never ran on a GPU).
        """
        if isinstance(device_descriptor, str):
            from ..descriptors import DescriptorError, load_descriptor

            try:
                device_descriptor = load_descriptor(device_descriptor)
            except DescriptorError as exc:
                from .cudnn_graph import _result

                return _result(code="cudnn.bad_descriptor", step="device", message=str(exc))
        device = {k: v for k, v in device_descriptor.items() if k != "_sources"}
        payload: dict[str, Any] = {
            "op": "probe",
            "config": dict(config_dict),
            "device": device,
            "sm": sm,
            "build_plans": build_plans,
            "use_real_gpu": use_real_gpu,
        }
        if heuristics is not None:
            payload["heuristics"] = list(heuristics)
        return self.request(payload, timeout_s)


__all__ = ["CudnnWorker", "START_TIMEOUT_S", "get_worker"]

_singleton: CudnnWorker | None = None
_singleton_lock = threading.Lock()


def get_worker() -> CudnnWorker:
    """The process-wide worker (created on first use, closed at exit)."""
    global _singleton
    with _singleton_lock:
        if _singleton is None:
            _singleton = CudnnWorker()
            atexit.register(_singleton.close)
        return _singleton


# ---------------------------------------------------------------------------------------- worker
def _scan_stderr(offset: int) -> tuple[int, list[str]]:
    """New "Could not load symbol X" lines on our stderr since ``offset`` (it is a file)."""
    try:
        size = os.fstat(2).st_size
    except OSError:
        return offset, []
    if size < offset:
        offset = 0
    if size == offset:
        return offset, []
    try:
        data = os.pread(2, min(size - offset, _STDERR_LIMIT), offset)
    except OSError:
        return size, []
    missing = []
    for ln in data.decode("utf-8", "replace").splitlines():
        if "Could not load symbol" in ln:
            name = ln.split("Could not load symbol", 1)[1].split(".")[0].strip()
            if name and name not in missing:
                missing.append(name)
    if size > _STDERR_LIMIT:
        with contextlib.suppress(OSError):
            os.ftruncate(2, 0)
        size = 0
    return size, missing


def _serve() -> int:  # pragma: no cover - runs in the worker subprocess (tested end to end)
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from . import cudnn_graph

    st = cudnn_graph.backend_status()
    from . import _stubcuda

    setup = _stubcuda.current_setup()
    hello = {
        "pid": os.getpid(),
        "ok": st["ok"],
        "error": st["error"],
        "driver": st["driver"],
        "stub_path": setup.path if setup and setup.mode == "stub" else None,
        "cudnn_version": st["cudnn_version"],
        "frontend_version": st["frontend_version"],
    }
    out.write(json.dumps({"hello": hello}) + "\n")
    offset, _ = _scan_stderr(0)
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
        except ValueError:
            continue
        op = req.get("op")
        if op == "exit":
            break
        if op == "ping":
            reply: dict[str, Any] = {"id": req.get("id"), "result": hello}
        elif op == "sleep":  # a test aid: a probe that takes a while (crash/timeout tests)
            time.sleep(float(req.get("seconds", 0)))
            reply = {"id": req.get("id"), "result": {"slept": req.get("seconds")}}
        elif op == "probe":
            try:
                result = cudnn_graph.probe_config(
                    req["config"],
                    req["device"],
                    req.get("sm"),
                    build_plans=bool(req.get("build_plans")),
                    heuristics=tuple(req.get("heuristics") or cudnn_graph.HEURISTICS),
                    use_real_gpu=bool(req.get("use_real_gpu")),
                )
            except Exception as exc:  # noqa: BLE001 - report, keep serving
                result = cudnn_graph._result(
                    code="cudnn.probe_error", step="mapping", message=f"{type(exc).__name__}: {exc}"
                )
            offset, missing = _scan_stderr(offset)
            if missing:
                result["notes"] = list(result.get("notes") or []) + [
                    "the stub driver lacks symbol(s) cuDNN asked for: " + ", ".join(missing)
                ]
                if not result.get("supported"):
                    result["decided"] = False
                    result["code"] = "cudnn.stub_incomplete"
            reply = {"id": req.get("id"), "result": result}
        else:
            reply = {"id": req.get("id"), "error": f"unknown op {op!r}"}
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_serve())
