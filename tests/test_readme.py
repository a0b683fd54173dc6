"""The README's support matrix is generated from the rules; a stale README fails here."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_support_matrix_is_current():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py"), "--check"],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr


def test_readme_test_command_matches_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/run" in readme and "pytest" in ci
