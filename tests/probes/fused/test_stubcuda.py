"""Issue 12: the stub driver is created private (0700 / 0600) whatever the umask, and a stub
already on disk is reused only when its owner, mode and hash match."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from te_fl_attention.probes.fused import stubcuda as _stubcuda

pytestmark = pytest.mark.skipif(_stubcuda.find_compiler() is None, reason="needs a C compiler")


@pytest.fixture
def stub_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache" / "stubcuda"
    monkeypatch.setenv("TE_FL_ATTENTION_STUB_DIR", str(root))
    old = os.umask(0)
    yield root
    os.umask(old)


def _mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_built_private_whatever_the_umask_and_loadable(stub_dir):
    path = _stubcuda.build_stub()
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700 and _mode(stub_dir) == 0o700
    assert _stubcuda.reuse_problem(path) is None
    code = (f"import ctypes; lib = ctypes.CDLL({str(path)!r}, mode=ctypes.RTLD_GLOBAL); "
            "print(lib.te_fl_attention_stub is not None)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


@pytest.mark.parametrize("tamper", ["content", "mode", "owner", "no-hash"])
def test_a_stub_is_reused_only_when_owner_mode_and_hash_match(stub_dir, tamper):
    path = _stubcuda.build_stub()
    good = path.read_bytes()
    inode = path.stat().st_ino
    assert _stubcuda.build_stub() == path and path.stat().st_ino == inode  # reused as is
    if tamper == "content":
        path.write_bytes(good + b"\0evil")
    elif tamper == "mode":
        os.chmod(path, 0o666)
    elif tamper == "owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to chown")
        os.chown(path, 12345, 12345)
    else:
        (path.parent / (path.name + ".sha256")).unlink()
    assert _stubcuda.reuse_problem(path) is not None
    rebuilt = _stubcuda.build_stub()
    assert rebuilt == path and path.read_bytes() == good and _mode(path) == 0o600
    assert path.stat().st_uid == os.geteuid()
    assert _stubcuda.reuse_problem(path) is None
