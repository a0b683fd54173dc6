"""Which GPU-only lines does the CPU test suite never execute?

GPU-only code is marked in the sources with a ``# gpu-only`` comment: on the line that opens a
block (``def``, ``if``, ``else:``, ``with``, ``try:`` ...) it marks the whole block, on any other
line that one statement. This script

1. collects the marked lines of ``te_fl_attention`` (statements only, via ``ast``);
2. runs the test suite (or ``--tests``) under coverage.py in branch mode, subprocesses included
   (``[run] patch = subprocess``: the cuDNN probe worker, the tiny-run worker, CLI and TE
   scenario processes), and combines the data;
3. prints every marked line that never ran, the calls inside marked code that the test seam
   replaces (the last calls that need hardware: device queries, the cuDNN handle, kernel
   launches, synchronization), and one summary line::

       gpu_branches files=N gpu_only_lines=L unexecuted_lines=M seam_calls=S

``M`` is the number that matters: every GPU-only line should be executed on CPU through the seam
(``tests/fakegpu``), with only the final hardware calls replaced. Exit status 0 (a report), 2
when the tests could not run. Takes ~1.5x the suite's time (``python benchmarks/gpu_branches.py``).
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "te_fl_attention"
MARK = "gpu-only"

#: Calls that need the hardware itself (what the test seam replaces).
SEAM_CALLS = re.compile(
    r"torch\.cuda\.(?!is_available\b)\w+|is_available\(\)|create_handle\(|"
    r"backend_graph\(|drv\.cu\w+|cuda\.bindings|\]\(\*|flash_attn\w*_func\(|fn\(|sdpa\(|"
    r"\.record\(|elapsed_time\(|synchronize\("
)


def marked_lines(path: Path) -> set[int]:
    """Line numbers of the statements a ``# gpu-only`` comment marks in ``path``."""
    source = path.read_text(encoding="utf-8")
    marks = [tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT and MARK in tok.string.lower()]  # fmt: skip
    if not marks:
        return set()
    tree = ast.parse(source)
    statements = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    lines = source.splitlines()
    out: set[int] = set()
    for line in marks:
        text = lines[line - 1].split("#", 1)[0].strip()
        opener = text.endswith(":")
        if opener and re.match(r"(else|elif\b|except\b|finally)", text):
            # a clause: the statements of the clause (they start after ``line``, end before
            # the next clause at the same indentation or the end of the parent)
            indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
            end = len(lines)
            for j in range(line, len(lines)):
                raw = lines[j]
                if raw.strip() and not raw.lstrip().startswith("#") and \
                        len(raw) - len(raw.lstrip()) <= indent:  # fmt: skip
                    end = j
                    break
            out |= {n.lineno for n in statements if line < n.lineno <= end}
            continue
        node = next((n for n in statements if n.lineno == line), None)
        if node is None:  # the comment sits on a continuation line: the enclosing statement
            around = [n for n in statements if n.lineno <= line <= (n.end_lineno or n.lineno)]
            node = min(around, key=lambda n: (n.end_lineno or n.lineno) - n.lineno, default=None)
        if node is None:
            continue
        if opener and hasattr(node, "body"):
            inner = {n.lineno for n in ast.walk(node) if isinstance(n, ast.stmt)}
            if isinstance(node, ast.If):  # the body only: an ``else`` has its own mark
                inner = {n.lineno for b in node.body for n in ast.walk(b)
                         if isinstance(n, ast.stmt)}  # fmt: skip
                inner.add(node.lineno)
            out |= inner
        else:
            out.add(node.lineno)
    return out


def collect() -> dict[Path, set[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = marked_lines(path)
        if lines:
            found[path] = lines
    return found


def run_suite(tests: list[str], data_file: Path) -> int:
    rc_file = data_file.parent / "coveragerc"
    rc_file.write_text(
        "[run]\nbranch = True\nparallel = True\n"
        f"source = {PACKAGE}\ndata_file = {data_file}\npatch = subprocess\n"
    )
    env = {**os.environ, "COVERAGE_RCFILE": str(rc_file)}
    cmd = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-p",
           "no:cacheprovider", "--no-header", *tests]  # fmt: skip
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    subprocess.call([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT, env=env)
    return rc


def executed(data_file: Path, paths: list[Path]) -> dict[Path, tuple[set[int], set[int]]]:
    """For each path: (its executable statements, the ones the suite ran), as coverage sees
    them (docstrings and other non-code lines are not statements)."""
    import coverage

    cov = coverage.Coverage(data_file=str(data_file), branch=True)
    cov.load()
    out = {}
    for path in paths:
        _, statements, _, missing, _ = cov.analysis2(str(path))
        out[path] = (set(statements), set(statements) - set(missing))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", nargs="*", default=["tests"], help="pytest paths (default: all)")
    ap.add_argument("--data", help="reuse this combined coverage data file instead of running")
    args = ap.parse_args(argv)
    marked = collect()
    if args.data:
        data_file = Path(args.data)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="gpu-branches-"))
        data_file = tmp / ".coverage"
        rc = run_suite(args.tests, data_file)
        if rc not in (0, 1):  # 1: some test failed; the coverage data still counts
            print(f"gpu_branches: the test run failed to start (pytest exit {rc})",
                  file=sys.stderr)  # fmt: skip
            return 2
    ran = executed(data_file, list(marked))
    total = missed = seams = 0
    for path, lines in marked.items():
        src = path.read_text(encoding="utf-8").splitlines()
        statements, hit = ran[path]
        rel = path.relative_to(ROOT)
        for n in sorted(lines & statements):
            total += 1
            code = src[n - 1].strip()
            if n not in hit:
                missed += 1
                print(f"unexecuted {rel}:{n}: {code}")
            elif SEAM_CALLS.search(code):
                seams += 1
                print(f"seam       {rel}:{n}: {code}")
    print(f"gpu_branches files={len(marked)} gpu_only_lines={total} unexecuted_lines={missed} "
          f"seam_calls={seams}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
