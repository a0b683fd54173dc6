"""Plugin fixture for test_registry.py: a module exposing ``register(registry)``."""

from te_fl_attention.plugin.registry import BackendImplKind, OpImpl, OpRegistry


def register(registry: OpRegistry) -> None:
    """Add a flagos implementation of ``fixture_op``."""
    registry.register(
        OpImpl("fixture_op", "flagos.fixture", BackendImplKind.FLAGOS, lambda: "from fixture")
    )
