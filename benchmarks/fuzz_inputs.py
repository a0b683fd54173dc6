"""Fuzz every boundary where input comes in from outside: argv, environment, config files,
imported cache rows and Redis values.

Cases are drawn by hypothesis (``--cases N``, seeded: ``--seed``) from seven kinds:

* ``argv``: ``te-fl-attn`` command lines from the CLI's grammar (``explain``, ``device``,
  ``matrix``, ``cache``), each flag given a well-formed or a malformed value (huge or negative
  numbers, non-numbers, unknown names, control characters, lone surrogates, conflicting flags,
  bad device overrides);
* ``env``: ``explain`` under random values of our ``TE_FL_ATTN_*`` switches and TE's ``NVTE_*``
  variables;
* ``config``: ``explain --config FILE`` with random JSON (wrong types, non-objects, deep nesting,
  huge numbers, unknown fields);
* ``import``: a real exported decision whose rows are mutated (verdicts flipped, wrong types,
  huge or non-finite numbers, far-future timestamps, huge strings, lone surrogates), imported into
  a fresh store, then ``explain`` of the same config;
* ``redis``: the same mutations written over the values a real ``redis-server`` holds (started
  here on 127.0.0.1), then ``explain`` from a fresh local store through the Redis tier;
* ``pack``: the same mutations written into a real SQLite pack (``cache export --format sqlite``)
  as a hostile writer would (CHECK constraints off, each row's columns kept in step with its
  mutated result and its checksum recomputed, so every row reaches the validator), then up to
  three runs of up to 64 bytes of the file overwritten; merged with the first store into a new
  file, imported into a fresh store, then ``explain``;
* ``store``: the same, on a copy of another store's file (imported and merged as a store).

Every case runs the CLI in this process (stdout/stderr captured, a 30 s alarm) and is judged:

* ``tracebacks``: an exception escaped the command (or a traceback was printed);
* ``hangs``: the alarm fired;
* ``wrong_exit``: an exit status outside the command's contract, or a malformed input (the case
  knows which parts it broke) that was accepted (exit 0/3), or ``--json`` output that is not
  strict JSON;
* ``widened``: after an import or a Redis read, the chosen backend is one that this process's own
  binding rules refuse (a cached row made a backend chosen that the local rules refuse).

Prints one line per failing case (``--verbose``) and::

    fuzz cases=10000 tracebacks=0 hangs=0 wrong_exit=0 widened=0

``tests/test_fuzz_inputs.py`` runs a bounded number of the same cases in the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: Seconds one case may take before it counts as a hang.
ALARM_S = 30
#: Exit statuses a command may end with (0 done / a backend, 2 bad input, 3 no backend; cache
#: commands: 1 for a failed operation).
EXITS = {"explain": {0, 2, 3}, "device": {0, 2}, "matrix": {0, 2}, "cache": {0, 1, 2}}


@dataclasses.dataclass
class Case:
    """One input: what to run, in which environment, with which files, and what it broke."""

    kind: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Which parts were deliberately malformed (an accepted malformed input is a wrong exit).
    broken: list[str] = dataclasses.field(default_factory=list)
    #: For import/redis/pack cases: the config explained and the row mutations applied.
    mutations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: For pack cases: runs of bytes overwritten in the file after the mutations (offset as a
    #: fraction of its size, the byte written, how many times).
    flips: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------ value pools
_BAD_TEXT = ["", " ", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "ab\x00cd", "\ud800",
             "x" * 5000, "١", "NaN", "inf", "-0", "1e999", "0x10", "None", "{}", "[]"]  # fmt: skip
_HUGE = ["99999999999999999999", "9" * 26, "-1", "-5", "0", "2147483648", "1e3", "3.5"]
_DEVICES_OK = ["h100", "a100", "b200", "rtx5090", "l40s", "t4", "h200", "rtx4090",
               "h100:cudnn=9.10.2", "a100:flash_attn=none", "b200:fa4=4.0.0b36"]  # fmt: skip
_DEVICES_BAD = ["h100:cudnn=banana", "h100:sm=-5", "h100:sm_count=-1", "h100:memory_gib=-3",
                "nosuchgpu", "h100:bogus=1", "h100:cudnn", "H100:", "h100:sm=1e9",
                "h100:cudnn=9.10.2,cudnn=9.28.1", ":"]  # fmt: skip
_PRESETS = ["llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b-swa"]
_ENV_OURS = ["TE_FL_ATTN_CUDNN_PROBE", "TE_FL_ATTN_CACHE_READONLY", "TE_FL_ATTN_VERIFY",
             "TE_FL_ATTN_MEASURE", "TE_FL_ATTN_TRITON", "TE_FL_ATTN_SEED_ENV"]  # fmt: skip
_ENV_TE = ["NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN_V3"]
_SWITCH_OK = ["0", "1"]
_SWITCH_BAD = ["false", "true", "2", "-1", "1 ", " 0", "١", "", "yes", "\x1b[0m"]


def _int_flag(name: str) -> st.SearchStrategy[tuple[list[str], list[str]]]:
    """``[flag, value]`` and what it broke (nothing for a plausible value)."""
    good = st.sampled_from(["1", "2", "8", "16", "64", "128"])
    bad = st.sampled_from(_HUGE + _BAD_TEXT)
    return st.one_of(good.map(lambda v: ([name, v], [])),
                     bad.map(lambda v: ([name, v], [f"{name} {v!r}"])))  # fmt: skip


@st.composite
def argv_case(draw: Any) -> Case:
    cmd = draw(st.sampled_from(["explain"] * 6 + ["device", "matrix", "cache"]))
    argv, broken = [cmd], []
    if cmd == "explain":
        if draw(st.booleans()):
            argv += ["--preset", draw(st.sampled_from(_PRESETS))]
        if draw(st.booleans()):
            dev_bad = draw(st.booleans())
            dev = draw(st.sampled_from(_DEVICES_BAD if dev_bad else _DEVICES_OK))
            argv += ["--device", dev]
            broken += [f"--device {dev!r}"] if dev_bad else []
        for flag in draw(st.lists(st.sampled_from(
                ["--seqlen", "--batch", "--num-heads", "--head-dim-qk", "--max-seqlen-q",
                 "--batch-size", "--num-gqa-groups", "--head-dim-v"]), max_size=3,
                unique=True)):  # fmt: skip
            part, why = draw(_int_flag(flag))
            argv += part
            broken += why
        values = dict(zip(argv[1::2], argv[2::2], strict=False))
        for a, b in (("--seqlen", "--max-seqlen-q"), ("--batch", "--batch-size")):
            if a in argv and b in argv and values.get(a) != values.get(b):
                broken.append(f"{a} {values.get(a)} with {b} {values.get(b)}")
        if draw(st.booleans()):
            v = draw(st.sampled_from(["bf16", "fp16", "fp32", "BF16", "fp64", "\x1b[31m"]))
            argv += ["--dtype", v]
            broken += [f"--dtype {v!r}"] if v in ("fp64", "\x1b[31m") else []
        if draw(st.booleans()):
            v = draw(st.sampled_from(["fused", "flash", "fa3", "triton", "unfused", "nope"]))
            argv += ["--force", v]
            broken += [f"--force {v!r}"] if v == "nope" else []
        if draw(st.booleans()):
            argv.append("--json")
    elif cmd == "device":
        name = draw(st.sampled_from([*_DEVICES_OK, *_DEVICES_BAD, "local", "--list"]))
        argv += [name] if name != "--list" else ["--list"]
        broken += [f"device {name!r}"] if name in _DEVICES_BAD else []
        if draw(st.booleans()):
            argv.append("--json")
    elif cmd == "cache":
        sub = draw(st.sampled_from(["stats", "path", "list", "show", "prune"]))
        argv.append(sub)
        if sub == "show":
            key = draw(st.sampled_from(["0" * 64, "zz", "\ud800", "a" * 300]))
            argv.append(key)
        if sub == "prune":
            v = draw(st.sampled_from(["10", "-1", "1e999", "abc"]))
            argv += ["--older-than", v]
            broken += [f"--older-than {v!r}"] if v in ("-1", "1e999", "abc") else []
    return Case("argv", argv, broken=broken)


@st.composite
def env_case(draw: Any) -> Case:
    env, broken = {}, []
    for name in draw(st.lists(st.sampled_from(_ENV_OURS + _ENV_TE), min_size=1, max_size=3,
                              unique=True)):  # fmt: skip
        bad = draw(st.booleans())
        value = draw(st.sampled_from(_SWITCH_BAD if bad else _SWITCH_OK))
        env[name] = value
        # NVTE_* are parsed as TE parses them (int(...)); only our switches are strict 0/1
        if bad and name in _ENV_OURS:
            broken.append(f"{name}={value!r}")
    preset = draw(st.sampled_from(_PRESETS))
    dev = draw(st.sampled_from(["h100", "a100", "b200"]))
    return Case("env", ["explain", "--preset", preset, "--device", dev, "--json"], env=env,
                broken=broken)  # fmt: skip


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=False, allow_infinity=False),
                       st.text(max_size=20))  # fmt: skip
_json_value = st.recursive(_json_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=10), kids, max_size=4)),
    max_leaves=12)  # fmt: skip
_FIELDS = {"num_heads": st.integers(1, 64), "head_dim_qk": st.sampled_from([64, 128, 256]),
           "max_seqlen_q": st.sampled_from([128, 1024, 4096]),
           "attn_mask_type": st.sampled_from(["causal", "no_mask", "padding_causal"]),
           "dtype": st.sampled_from(["bf16", "fp16", "fp32"])}  # fmt: skip


@st.composite
def config_case(draw: Any) -> Case:
    shape = draw(st.sampled_from(["object", "object", "garbage", "deep", "huge", "not_object"]))
    broken: list[str] = []
    if shape == "object":
        data: Any = {k: draw(v) for k, v in _FIELDS.items() if draw(st.booleans())}
        text = json.dumps(data)
    elif shape == "garbage":
        data = {draw(st.sampled_from([*_FIELDS, "bogus", "num_heads"])): draw(_json_value)}
        text = json.dumps(data)
        broken.append("a field of the wrong type or unknown")
    elif shape == "deep":
        depth = draw(st.sampled_from([200, 5000, 100_000]))
        text = '{"num_heads": ' + "[" * depth + "]" * depth + "}"
        broken.append(f"{depth}-deep nesting")
    elif shape == "huge":
        text = json.dumps({"max_seqlen_q": int("9" * draw(st.integers(11, 400)))})
        broken.append("a huge number")
    else:
        text = draw(st.sampled_from(["null", "42", "[1,2]", '"ab"', '[["num_heads",8]]', "",
                                     "{", "NaN", '{"num_heads": NaN}']))  # fmt: skip
        broken.append(f"--config holding {text!r}")
    dev = draw(st.sampled_from(["h100", "a100"]))
    case = Case("config", ["explain", "--config", "{dir}/config.json", "--device", dev],
                files={"config.json": text}, broken=broken)  # fmt: skip
    # a well-formed object can still be an invalid config (e.g. heads that do not divide)
    if shape == "garbage" and isinstance(data, dict) and set(data) <= set(_FIELDS):
        case.broken = []  # maybe valid: judged only on tracebacks / hangs / exit set
    return case


_MUTATIONS = [
    {"path": ["result", "supported"], "value": True}, {"path": ["result", "supported"],
                                                      "value": "false"},
    {"path": ["result", "stage"], "value": "graph_build"},
    {"path": ["result", "stage"], "value": "bogus"},
    {"path": ["result", "elapsed_ms"], "value": int("9" * 400)},
    {"path": ["result", "elapsed_ms"], "value": "NaN"},
    {"path": ["result", "reasons"], "value": []},
    {"path": ["result", "reasons"], "value": 5},
    {"path": ["result", "evidence"], "value": "\x1b]0;pwned\x07\ud800" * 3},
    {"path": ["result", "detail"], "value": {"a": [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]}},
    {"path": ["result", "detail"], "value": {"blob": "x" * 2_000_000}},
    {"path": ["created_at"], "value": 4_102_444_800.0 * 100},
    {"path": ["created_at"], "value": "yesterday"},
    {"path": ["context", "device"], "value": 5},
    {"path": ["context", "device"], "value": {"name": "h100\x1b]0;pwned\x07\x1b[2J", "sm": 90}},
    {"path": ["backend"], "value": "cuda"},
    {"path": ["result", "backend"], "value": "unfused"},
]  # fmt: skip
#: (config flags, device) whose local rules refuse some candidate (so a flipped row could widen).
_WIDEN_TARGETS = [
    (["--dtype", "fp32", "--seqlen", "256", "--num-heads", "8"], "h100"),
    (["--head-dim-qk", "320", "--num-heads", "4", "--seqlen", "256"], "a100"),
    (["--bias-type", "pre_scale_bias", "--bias-shape", "1hss", "--num-heads", "4"], "b200"),
    (["--preset", "llama3-8b", "--seqlen", "512"], "t4"),
]


@st.composite
def rows_case(draw: Any, kind: str) -> Case:
    flags, dev = draw(st.sampled_from(_WIDEN_TARGETS))
    muts = draw(st.lists(st.sampled_from(_MUTATIONS), min_size=1, max_size=3))
    which = draw(st.sampled_from(["fused", "flash", "triton", "all"]))
    muts = [{**m, "backend": which} for m in muts]
    flips = draw(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255), st.integers(1, 64)),
                          max_size=3) if kind in ("pack", "store") else st.just([]))  # fmt: skip
    return Case(kind, ["explain", *flags, "--device", dev, "--json"], mutations=muts,
                flips=flips)  # fmt: skip


def cases() -> st.SearchStrategy[Case]:
    return st.one_of(argv_case(), env_case(), config_case(), rows_case("import"),
                     rows_case("redis"), rows_case("pack"), rows_case("store"))  # fmt: skip


# ------------------------------------------------------------------------------ running
class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang(f"no answer within {ALARM_S} s")


@dataclasses.dataclass
class Outcome:
    rc: int | None
    stdout: str
    stderr: str
    error: str | None = None  # an escaped exception's traceback
    hang: bool = False


def _reset_process_state() -> None:
    from te_fl_attention import device, selector
    from te_fl_attention.cache import tiered

    selector._DEFAULT = None
    tiered.reset_default_cache()
    device.local.cache_clear()


def run_cli(argv: list[str], env: dict[str, str], workdir: Path) -> Outcome:
    """``te-fl-attn argv`` in this process with ``env`` added and a fresh default store."""
    from te_fl_attention import cli

    argv = [a.replace("{dir}", str(workdir)) for a in argv]
    saved = dict(os.environ)
    os.environ.update(env)
    os.environ.setdefault("TE_FL_ATTN_CACHE", str(workdir / "probes.sqlite"))
    _reset_process_state()
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    result = Outcome(None, "", "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result.rc = cli.main(argv)
            except SystemExit as exc:
                result.rc = exc.code if isinstance(exc.code, int) else 2
    except Hang:
        result.hang = True
    except BaseException:  # noqa: BLE001 - that is what is being counted
        result.error = traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.environ.clear()
        os.environ.update(saved)
        _reset_process_state()
    result.stdout, result.stderr = out.getvalue(), err.getvalue()
    return result


def _strict_json(text: str) -> bool:
    def bad_constant(name: str) -> Any:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=bad_constant)
    except ValueError:
        return False
    return True


def _mutate(row: dict[str, Any], m: dict[str, Any]) -> None:
    if m["backend"] not in ("all", row.get("backend")):
        return
    target = row
    for key in m["path"][:-1]:
        target = target.setdefault(key, {}) if isinstance(target, dict) else {}
    if isinstance(target, dict):
        target[m["path"][-1]] = m["value"]


def _dump(obj: Any) -> str:
    return json.dumps(obj, default=str, allow_nan=True)


class Redis:
    """A throwaway redis-server on 127.0.0.1 (None when redis-server is not installed)."""

    def __init__(self) -> None:
        self.proc = None
        self.url = None
        exe = shutil.which("redis-server")
        if exe is None:
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
               "no"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            try:
                self.client.ping()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{port}/0"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def local_refusal(argv: list[str], chosen: str | None) -> str | None:
    """Why this process's own binding rules refuse ``chosen`` for the config of ``argv`` (a
    rules-only decision; ``cudnn_table.*`` predictions are not binding), or None."""
    if chosen is None:
        return None
    from te_fl_attention import cli
    from te_fl_attention.cli.explain import build_config
    from te_fl_attention.probes import default_probes
    from te_fl_attention.selector import Selector

    args = cli.parser().parse_args(argv)
    config = build_config(args)
    d = Selector(default_probes(graph=False)).decide(config, args.device)
    r = d.result(chosen)
    binding = [x for x in r.reasons if not x.code.startswith("cudnn_table.")
               and x.stage in ("rule", "policy", "import")]  # fmt: skip
    return f"{binding[0].code}: {binding[0].message}" if binding else None


def execute(case: Case, redis: Redis | None = None) -> dict[str, Any]:
    """Run one case; returns its judgement (``{"tracebacks": 0|1, ...}`` and a description)."""
    work = Path(tempfile.mkdtemp(prefix="te-fl-fuzz-"))
    try:
        for name, text in case.files.items():
            (work / name).write_text(text, encoding="utf-8", errors="surrogatepass")
        env = dict(case.env)
        if case.kind in ("import", "redis", "pack", "store"):
            return _execute_rows(case, work, env, redis)
        out = run_cli(case.argv, env, work)
        return judge(case, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _execute_rows(case: Case, work: Path, env: dict[str, str], redis: Redis | None
                  ) -> dict[str, Any]:  # fmt: skip
    """Probe the config for real, corrupt what was stored (an export file, or Redis's values),
    then explain it again from a fresh local store fed only by the corrupted source."""
    first = {**env, "TE_FL_ATTN_CACHE": str(work / "a.sqlite")}
    if case.kind == "redis":
        if redis is None or redis.url is None:
            return {"skipped": "no redis-server"}
        redis.client.flushall()
        first["TE_FL_ATTN_REMOTE_CACHE"] = redis.url
    seeded = run_cli(case.argv, first, work)
    if seeded.error or seeded.hang:
        return judge(case, seeded)
    second = {**env, "TE_FL_ATTN_CACHE": str(work / "b.sqlite")}
    if case.kind == "import":
        exported = run_cli(["cache", "export", str(work / "rows.jsonl")], first, work)
        if exported.error or exported.hang:
            return judge(case, exported)
        lines = (work / "rows.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(ln) for ln in lines if ln.strip()]
        for row in rows:
            for m in case.mutations:
                _mutate(row, m)
        (work / "rows.jsonl").write_text("\n".join(_dump(r) for r in rows) + "\n",
                                         encoding="utf-8", errors="surrogatepass")  # fmt: skip
        imported = run_cli(["cache", "import", str(work / "rows.jsonl")], second, work)
        verdict = judge(Case("import", ["cache", "import"]), imported)
        if any(verdict[k] for k in ("tracebacks", "hangs", "wrong_exit")):
            return verdict
    elif case.kind in ("pack", "store"):
        source = work / ("rows.pack" if case.kind == "pack" else "rows.sqlite")
        if case.kind == "pack":
            exported = run_cli(["cache", "export", "--format", "sqlite", str(source)], first, work)
            if exported.error or exported.hang:
                return judge(case, exported)
        else:  # another store's file, its WAL folded in (the two share the tables)
            _fold_copy(work / "a.sqlite", source)
        _corrupt_rows(source, case.mutations, case.flips)
        merge = ["cache", "merge", "-o", str(work / "merged.sqlite"), str(source),
                 str(work / "a.sqlite")]  # fmt: skip
        merged = run_cli(merge, second, work)
        verdict = judge(Case(case.kind, ["cache", "merge"]), merged)
        if any(verdict[k] for k in ("tracebacks", "hangs", "wrong_exit")):
            return verdict
        imported = run_cli(["cache", "import", str(source)], second, work)
        verdict = judge(Case(case.kind, ["cache", "import"]), imported)
        if any(verdict[k] for k in ("tracebacks", "hangs", "wrong_exit")):
            return verdict
    else:
        for key in redis.client.scan_iter(match="*:r:*"):
            try:
                row = {"result": json.loads(redis.client.get(key))}
            except (TypeError, ValueError):
                continue
            row["backend"] = row["result"].get("backend")
            for m in case.mutations:
                _mutate(row, m)
            redis.client.set(key, _dump(row["result"]))
        second["TE_FL_ATTN_REMOTE_CACHE"] = redis.url
    out = run_cli(case.argv, second, work)
    verdict = judge(case, out)
    if out.rc in (0, 3) and not verdict["wrong_exit"]:
        chosen = json.loads(out.stdout).get("chosen")
        why = local_refusal(case.argv, chosen)
        if why is not None:
            verdict["widened"] = 1
            verdict["why"] = f"chose {chosen}, which the local rules refuse ({why})"
    if any(verdict[k] for k in ("tracebacks", "hangs", "wrong_exit", "widened")):
        return verdict
    for argv in (["cache", "list"], ["cache", "stats"]):  # what was stored, shown as text
        shown = run_cli(argv, second, work)
        verdict = judge(Case(case.kind, argv), shown)
        if not any(verdict[k] for k in ("tracebacks", "hangs", "wrong_exit")) and \
                _RAW_CONTROL.search(shown.stdout + shown.stderr):  # fmt: skip
            verdict["wrong_exit"] = 1
            verdict["why"] = f"{' '.join(argv)} printed a raw control character"
        if any(verdict[k] for k in ("tracebacks", "hangs", "wrong_exit")):
            return verdict
    return verdict


#: Terminal control characters (tab and newline aside) that text output must never print raw.
_RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _sql_value(value: Any) -> Any:
    """A mutated value as a hostile writer stores it: JSON text for containers, text for an
    integer SQLite cannot hold, bytes stored as text for a string UTF-8 cannot encode."""
    if isinstance(value, (dict, list)):
        return _dump(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        return str(value)
    return value


def _fold_copy(store: Path, out: Path) -> None:
    """Copy a store's file with its WAL folded in (SQLite's backup: one consistent file)."""
    import sqlite3

    src = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    dst = sqlite3.connect(out)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def _corrupt_rows(path: Path, mutations: list[dict[str, Any]],
                  flips: list[tuple[float, int, int]]) -> None:  # fmt: skip
    """Apply ``mutations`` to every row of a real pack (or store: the same tables) and overwrite
    the runs of ``flips``."""
    import sqlite3

    from te_fl_attention.cache.compact import expand, pieces
    from te_fl_attention.cache.keys import CacheKey
    from te_fl_attention.cache.rows import row_crc_bytes

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA ignore_check_constraints=ON")  # as a hostile writer may
    conn.execute("BEGIN")
    contexts = {c: (fp, vk, dev) for c, fp, vk, dev in conn.execute("SELECT * FROM contexts")}
    compact = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'templates'"
                           ).fetchone()[0]  # fmt: skip
    rows = conn.execute(
        "SELECT p.config_key, p.backend, p.ctx, p.created_at, p.result, p.rid, p.elapsed_ms,"
        " p.e1, p.e2, p.e3, t.template FROM probes p LEFT JOIN templates t ON t.rid = p.rid"
        if compact else "SELECT config_key, backend, ctx, created_at, result, NULL, NULL, NULL,"
        " NULL, NULL, NULL FROM probes")  # fmt: skip
    for ck, backend, ctx, created, text, rid, *values, template in rows.fetchall():
        if rid is not None:  # a compact row: mutated and written back in full
            text = expand(pieces(template.encode()), *values).decode()
        fp, vk, dev = contexts[ctx]
        row = {"backend": backend, "created_at": created, "result": json.loads(text),
               "context": {"device": json.loads(dev) if dev else None}}  # fmt: skip
        for m in mutations:
            _mutate(row, m)
        result = row["result"]
        data = _dump(result).encode("utf-8", "surrogatepass")
        new_backend = _sql_value(row["backend"])
        key = CacheKey(ck, str(new_backend), fp, vk)
        try:
            crc = row_crc_bytes(key, data)
        except UnicodeEncodeError:
            crc = 0
        conn.execute(
            "UPDATE OR IGNORE probes SET backend = ?, supported = ?, stage = ?, elapsed_ms = ?,"
            " created_at = ?, crc = ?, result = CAST(? AS TEXT)"
            + (", rid = NULL, e1 = NULL, e2 = NULL, e3 = NULL" if compact else "")
            + " WHERE config_key = ? AND backend = ? AND ctx = ?",
            (new_backend, _sql_value(result.get("supported")), _sql_value(result.get("stage",
             "rule")), _sql_value(result.get("elapsed_ms", 0.0)), _sql_value(row["created_at"]),
             crc, data, ck, backend, ctx))  # fmt: skip
        device = row["context"].get("device") if isinstance(row["context"], dict) else None
        if device is not None and device != (json.loads(dev) if dev else None):  # (mutated)
            dumped = _dump(device).encode("utf-8", "surrogatepass")
            conn.execute("UPDATE contexts SET device = CAST(? AS TEXT) WHERE ctx = ?",
                         (dumped, ctx))  # fmt: skip
    conn.execute("COMMIT")
    conn.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        for where, byte, run in flips:
            at = min(size - 1, int(where * size))
            f.seek(at)
            f.write(bytes([byte]) * min(run, size - at))


def judge(case: Case, out: Outcome) -> dict[str, Any]:
    verdict: dict[str, Any] = {"tracebacks": 0, "hangs": 0, "wrong_exit": 0, "widened": 0}
    command = case.argv[0] if case.argv else "explain"
    if out.hang:
        verdict["hangs"], verdict["why"] = 1, "hang"
    elif out.error or "Traceback (most recent call last)" in out.stderr + out.stdout:
        verdict["tracebacks"] = 1
        verdict["why"] = (out.error or out.stderr)[-1500:]
    elif out.rc not in EXITS.get(command, {0, 2, 3}):
        verdict["wrong_exit"], verdict["why"] = 1, f"exit {out.rc}"
    elif case.broken and out.rc in (0, 3) and command != "cache":
        verdict["wrong_exit"] = 1
        verdict["why"] = f"accepted malformed input ({'; '.join(case.broken)}), exit {out.rc}"
    elif "--json" in case.argv and out.rc in (0, 3) and not _strict_json(out.stdout):
        verdict["wrong_exit"], verdict["why"] = 1, "--json output is not strict JSON"
    elif out.rc == 2 and not out.stderr.strip():
        verdict["wrong_exit"], verdict["why"] = 1, "exit 2 without saying why"
    return verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("TE_FL_ATTN_DESCRIPTORS", tempfile.mkdtemp(prefix="te-fl-fuzz-desc-"))
    redis = Redis()
    totals = {"cases": 0, "tracebacks": 0, "hangs": 0, "wrong_exit": 0, "widened": 0}
    skipped = 0
    t0 = time.perf_counter()

    @settings(max_examples=args.cases, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(case=cases())
    def one(case: Case) -> None:
        nonlocal skipped
        verdict = execute(case, redis)
        if verdict.get("skipped"):
            skipped += 1
            return
        totals["cases"] += 1
        for k in ("tracebacks", "hangs", "wrong_exit", "widened"):
            totals[k] += verdict[k]
        if args.verbose and verdict.get("why"):
            print(f"FAIL {case.kind} {case.argv!r} env={case.env!r}: "
                  f"{verdict['why'][:600]!r}", flush=True)  # fmt: skip

    from hypothesis import seed as hseed

    try:
        hseed(args.seed)(one)()
    finally:
        redis.close()
    print(f"fuzz cases={totals['cases']} tracebacks={totals['tracebacks']} "
          f"hangs={totals['hangs']} wrong_exit={totals['wrong_exit']} "
          f"widened={totals['widened']}" + (f" (skipped {skipped}: no redis-server)"
                                            if skipped else "")
          + f" seconds={time.perf_counter() - t0:.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
