"""The input fuzzer (``benchmarks/fuzz_inputs.py``), bounded: argv, environment, ``--config``
files, imported rows, Redis values (a real ``redis-server`` on 127.0.0.1), SQLite packs and store
files never end in a traceback, a hang, an exit outside the contract, accepted malformed input,
or a cached row that makes a backend chosen which the local rules refuse."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_inputs  # noqa: E402


@pytest.fixture(scope="module")
def redis():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = fuzz_inputs.Redis()
    yield server
    server.close()


@pytest.mark.parametrize("kind", ["argv", "env", "config", "import", "redis", "pack", "store"])
def test_fuzzed_inputs_hold_every_boundary(kind, request, tmp_path, monkeypatch):
    redis = request.getfixturevalue("redis") if kind == "redis" else None
    monkeypatch.setenv("TE_FL_ATTN_DESCRIPTORS", str(tmp_path / "descriptors"))
    strategy = {"argv": fuzz_inputs.argv_case(), "env": fuzz_inputs.env_case(),
                "config": fuzz_inputs.config_case(), "import": fuzz_inputs.rows_case("import"),
                "redis": fuzz_inputs.rows_case("redis"),
                "pack": fuzz_inputs.rows_case("pack"),
                "store": fuzz_inputs.rows_case("store")}[kind]  # fmt: skip
    failures = []

    @settings(max_examples=12, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=strategy)
    def run(case):
        verdict = fuzz_inputs.execute(case, redis)
        if any(verdict.get(k) for k in ("tracebacks", "hangs", "wrong_exit", "widened")):
            failures.append((case.argv, case.env, case.broken, verdict.get("why", "")[:800]))

    run()
    assert not failures, "\n".join(map(repr, failures))
