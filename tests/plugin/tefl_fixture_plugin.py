"""Plugin fixture for test_ops_discovery.py: a module exposing ``register(registry)``."""

from te_fl_attention.plugin.ops import BackendImplKind, OpImpl, OpRegistry


def register(registry: OpRegistry) -> None:
    """Add a flagos implementation of ``fixture_op``."""
    registry.register(
        OpImpl("fixture_op", "flagos.fixture", BackendImplKind.FLAGOS, lambda: "from fixture")
    )
