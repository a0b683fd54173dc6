"""Installs the test suite's fake GPU in a child process (see ``tests/fakegpu``).

Active only when ``TE_FL_TEST_FAKE_GPU`` is set (``FakeGPU.child_env`` sets it); otherwise it does
nothing, so a child that inherits this ``PYTHONPATH`` without the variable runs unchanged.
"""

import os

if os.environ.get("TE_FL_TEST_FAKE_GPU"):
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "__init__.py")
    _spec = importlib.util.spec_from_file_location("fakegpu", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules.setdefault("fakegpu", _mod)
    _spec.loader.exec_module(_mod)
    _mod.install_from_env()
