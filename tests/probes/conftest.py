"""Fixtures for the probe tests: ``te_selector`` drives TE 2.20.2's real selector on CPU."""

from te_cpu import te_selector  # noqa: F401
