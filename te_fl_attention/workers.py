"""Worker processes: a long-lived child per job kind, JSON lines over pipes, timeouts, respawn.

Two kinds of work must not run in the caller's process: cuDNN graph planning (cuDNN may abort its
process; the deviceless setup loads a stub driver; :mod:`.probes.fused.worker`) and GPU tiny
runs (a faulting kernel poisons its CUDA context; :mod:`.run_worker`). Both use
:class:`JsonWorker`:

* ``python -m <module> <args>`` is spawned lazily on the first request and reused; its first
  stdout line is ``{"hello": {...}}``, then one JSON reply line per JSON request line (the child
  keeps the protocol on a private copy of its stdout; its stderr goes to a temporary file whose
  tail explains a death);
* a request that kills the child or runs past its timeout (the child is then killed) raises
  :class:`WorkerFailure` (``died`` / ``timeout``); a child that cannot start raises it with kind
  ``start``; a child found dead between requests is replaced and the next reply says so (notes);
* a child bound to one GPU sees only that one: :func:`worker_env` narrows
  ``CUDA_VISIBLE_DEVICES`` to the parent's device (on an 8-GPU node, rank 3's workers open a
  context on GPU 3 and nowhere else).
"""

from __future__ import annotations

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: Seconds a new worker may take to start (interpreter, imports, a stub compile).
START_TIMEOUT_S = 120.0
#: Bytes of the worker's stderr quoted in a failure report.
STDERR_TAIL = 1500
#: Set in a device-bound worker's environment: the parent's device ordinal it stands for.
DEVICE_ENV = "TE_FL_ATTN_WORKER_DEVICE"


class WorkerFailure(RuntimeError):
    """The worker died (``kind="died"``) or timed out (``"timeout"``) during a request, or could
    not start (``"start"``)."""

    def __init__(self, kind: str, message: str, notes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.notes = list(notes)


def describe_exit(returncode: int | None) -> str:
    """``died (signal 9, SIGKILL)`` / ``exited with status 3`` / ``is unresponsive``."""
    if returncode is None:
        return "is unresponsive"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"died (signal {-returncode}, {name})"
    return f"exited with status {returncode}"


def visible_device(ordinal: int, parent_visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a child only the parent's CUDA device
    ``ordinal``: the parent's own list entry ``ordinal`` when it has a list (entries may be
    indices, ``GPU-<uuid>`` or ``MIG-...`` ids, passed on verbatim), else the index itself.
    ``None`` when the parent's list has no entry ``ordinal`` (the device cannot be named)."""
    if parent_visible is None or not parent_visible.strip():
        return str(ordinal)
    entries = [e.strip() for e in parent_visible.split(",")]
    if not 0 <= ordinal < len(entries) or not entries[ordinal]:
        return None
    return entries[ordinal]


def worker_env(base: Mapping[str, str], device: int | None) -> dict[str, str]:
    """The environment of a worker for the parent's device ``device`` (``None``: unchanged):
    ``CUDA_VISIBLE_DEVICES`` narrowed to that one device (:func:`visible_device`; the parent's
    ``CUDA_DEVICE_ORDER`` is inherited, so an index names the same GPU) and
    :data:`DEVICE_ENV` set to the parent's ordinal."""
    env = dict(base)
    if device is None:
        return env
    visible = visible_device(device, env.get("CUDA_VISIBLE_DEVICES"))  # gpu-only
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env[DEVICE_ENV] = str(device)
    return env


def current_device(*, load_torch: bool = True) -> int | None:
    """This process's current CUDA device, or ``None`` without a GPU (or a broken CUDA install).
    torch is imported here unless ``load_torch=False`` (then only an already imported torch
    is asked: the cuDNN worker never imports it)."""
    torch = sys.modules.get("torch")
    if torch is None and load_torch:
        try:
            import torch
        except ImportError:
            return None
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.current_device())  # gpu-only
    except Exception:  # noqa: BLE001 - a broken CUDA install: no device to name
        return None


class JsonWorker:
    """One worker process (see the module doc). Thread-safe: requests are serialized.
    ``close()`` ends it; the object stays usable (the next request spawns a new one).

    ``name`` names it in messages ("probe worker"), ``job`` names one request ("probe", "run").
    ``device``: the parent's CUDA device it is bound to (``None``: not narrowed)."""

    def __init__(self, module: str, args: Sequence[str] = (), *,
                 env: Mapping[str, str] | None = None, device: int | None = None,
                 name: str = "worker", job: str = "request",
                 start_timeout_s: float = START_TIMEOUT_S) -> None:  # fmt: skip
        self.module, self.args, self.name, self.job = module, tuple(args), name, job
        self.device = device
        self.start_timeout_s = start_timeout_s
        self._env = dict(env) if env is not None else None
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr_path: str | None = None
        self._buf = b""
        self._next_id = 0
        self.hello: dict[str, Any] | None = None
        #: Workers started so far (a test and benchmark aid).
        self.starts = 0

    @property
    def base_env(self) -> Mapping[str, str]:
        """The environment the worker's is derived from (the caller's, unless one was given)."""
        return os.environ if self._env is None else self._env

    # ------------------------------------------------------------------ process management
    @property
    def pid(self) -> int | None:
        """The running worker's pid, or ``None``."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def spawn_env(self) -> dict[str, str]:
        """The worker's environment: narrowed to its device, this package importable."""
        pkg_root = str(Path(__file__).resolve().parents[1])
        env = worker_env(self.base_env, self.device)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        return env

    def _spawn(self) -> None:
        fd, path = tempfile.mkstemp(prefix=f"te-fl-{self.job}-worker-", suffix=".stderr")
        os.close(fd)
        self._stderr_path = path
        # read+append: the child may scan its own stderr (pread) and truncate it (O_APPEND)
        with open(path, "a+b") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=self.spawn_env(), bufsize=0,
                close_fds=True)  # fmt: skip
        self._buf = b""
        self.starts += 1
        try:
            line = self._read_line(self.start_timeout_s)
        except TimeoutError:
            self._kill()
            self._discard()
            raise WorkerFailure("start", f"the {self.name} did not start within "
                                f"{self.start_timeout_s:g} s") from None  # fmt: skip
        if line is None:
            rc = self._reap()
            tail = self.stderr_tail()
            self._discard()
            raise WorkerFailure("start", f"the {self.name} {describe_exit(rc)} while starting"
                                + (f"; stderr: {tail}" if tail else ""))  # fmt: skip
        self.hello = json.loads(line).get("hello")

    def _ensure(self) -> list[str]:
        """A live worker; returns notes about a predecessor found dead."""
        notes: list[str] = []
        if self._proc is not None and self._proc.poll() is not None:
            old, rc = self._proc.pid, self._proc.returncode
            tail = self.stderr_tail()
            notes.append(f"the previous {self.name} (pid {old}) had {describe_exit(rc)} while "
                         "idle; a new one was started" + (f" (its stderr: {tail})" if tail
                                                          else ""))  # fmt: skip
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

    def stderr_tail(self) -> str:
        """The last :data:`STDERR_TAIL` bytes the current worker wrote to its stderr."""
        if not self._stderr_path:
            return ""
        try:
            with open(self._stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - STDERR_TAIL))
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

    def __enter__(self) -> JsonWorker:
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

    def request(self, payload: Mapping[str, Any], timeout_s: float
                ) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
        """Send one request; returns its reply and notes about a predecessor found dead. Raises
        :class:`WorkerFailure` when the worker cannot start, dies during the request or runs
        past ``timeout_s`` (it is killed; the next request starts a new one)."""
        with self._lock:
            notes = self._ensure()
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            self._next_id += 1
            pid = proc.pid
            try:
                proc.stdin.write((json.dumps({**payload, "id": self._next_id}) + "\n").encode())
                proc.stdin.flush()
                line = self._read_line(timeout_s)
            except TimeoutError:
                self._kill()
                tail = self.stderr_tail()
                self._discard()
                raise WorkerFailure("timeout", f"the {self.name} (pid {pid}) timed out after "
                                    f"{timeout_s:g} s and was killed; the next {self.job} starts "
                                    "a new one" + (f"\nstderr: {tail}" if tail else ""),
                                    notes) from None  # fmt: skip
            except OSError:  # a broken pipe: it died before reading the request
                line = None
            if line is None:
                rc = self._reap()
                tail = self.stderr_tail()
                self._discard()
                raise WorkerFailure("died", f"the {self.name} (pid {pid}) {describe_exit(rc)} "
                                    f"during the {self.job}; the next {self.job} starts a new "
                                    "one" + (f"\nstderr: {tail}" if tail else ""), notes)
            return json.loads(line), notes


class WorkerPool:
    """One worker per parent device, made by ``factory(device)`` on first use and closed at
    interpreter exit (``None``: the worker that is bound to no device)."""

    def __init__(self, factory: Any) -> None:
        self._factory = factory
        self._workers: dict[int | None, Any] = {}
        self._lock = threading.Lock()
        self._registered = False

    def get(self, device: int | None) -> Any:
        with self._lock:
            worker = self._workers.get(device)
            if worker is None:
                worker = self._workers[device] = self._factory(device)
                if not self._registered:
                    import atexit

                    atexit.register(self.close_all)
                    self._registered = True
            return worker

    def close_all(self) -> None:
        """Stop every worker (they respawn on the next request)."""
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.close()


# ------------------------------------------------------------------------ the child's side
#: ``handle(op, request) -> (reply fields, stop after replying)``.
Handler = Callable[[str, dict[str, Any]], tuple[dict[str, Any], bool]]


def protocol_stdout() -> IO[str]:
    """In a worker, first thing: a private copy of stdout for the replies; fd 1 then points at
    stderr, so whatever a library prints (C++ included) cannot corrupt a reply."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(out: IO[str], hello: dict[str, Any], handle: Handler) -> int:
    """The worker's loop: the hello line, then one reply per request line (``exit`` ends it,
    ``ping`` answers the hello, every other op goes to ``handle``). Returns the exit status."""
    out.write(json.dumps({"hello": hello}) + "\n")
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
        except ValueError:
            continue
        op = req.get("op")
        if op == "exit":
            break
        fields, stop = ({"result": hello}, False) if op == "ping" else handle(op, req)
        out.write(json.dumps({"id": req.get("id"), **fields}) + "\n")
        if stop:
            break
    return 0


__all__ = ["DEVICE_ENV", "JsonWorker", "START_TIMEOUT_S", "STDERR_TAIL", "WorkerFailure",
           "WorkerPool", "current_device", "describe_exit", "protocol_stdout", "serve",
           "visible_device", "worker_env"]
