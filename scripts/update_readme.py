"""Regenerate the README's support matrix from the rule predicates.

``python scripts/update_readme.py`` rewrites the block between the matrix markers;
``--check`` exits 1 when the README is stale (the test suite runs the same check).
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from te_fl_attention.cli.matrix import markdown  # noqa: E402

START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{markdown()}{END}{tail}"


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print("README.md support matrix is stale: run python scripts/update_readme.py")
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
