"""The package's layout rules that a linter does not check: no module reaches into another
module's private names (scripts/check_private_imports.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]



def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_private_imports", ROOT / "scripts" / "check_private_imports.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _unnumbered(line: str) -> str:
    return re.sub(r":\d+: ", ": ", line, count=1)


def test_no_module_reaches_into_another_modules_private_names():
    found = {_unnumbered(line) for line in _checker().reaches(ROOT)}
    assert found == set(), "reaches into private names"


def test_the_checker_sees_every_kind_of_reach(tmp_path):
    pkg = tmp_path / "te_fl_attention"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "_hidden = 1\nshown = 2\n__version__ = '0'\n",
        "_priv.py": "",  # a private module of the package its importer is in: fine
        "sub/_deep.py": "x = 1\n",
        "sub/__init__.py": "from . import _inner\n",  # its own private module: fine
        "sub/_inner.py": "",
        "b.py": (
            "from .a import _hidden, shown, __version__\n"
            "from . import a\n"
            "import te_fl_attention.a as aa\n"
            "from .sub import _inner\n"
            "from ._priv import x\n"
            "from .sub._deep import x as y\n"
            "def f():\n"
            "    from te_fl_attention.a import _hidden as h\n"
            "    return a._hidden, aa._hidden, a.shown, a.__version__, h\n"
        ),
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = sorted(_unnumbered(line) for line in _checker().reaches(tmp_path))
    assert found == sorted([
        "te_fl_attention/b.py: from te_fl_attention.a import _hidden",
        "te_fl_attention/b.py: from te_fl_attention.a import _hidden",
        "te_fl_attention/b.py: from te_fl_attention.sub import _inner",
        "te_fl_attention/b.py: from te_fl_attention.sub._deep import ...",
        "te_fl_attention/b.py: a._hidden",
        "te_fl_attention/b.py: aa._hidden",
    ])
