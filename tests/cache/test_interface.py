"""Every cache the package builds implements both interfaces: the selector's small one and the
admin one (stats, prune, iterate), without attribute forwarding."""

from __future__ import annotations

from te_fl_attention.cache import MemoryCache, ProbeCache
from te_fl_attention.cache.interface import AdminStore, Store
from te_fl_attention.cache.remote import RedisTier
from te_fl_attention.cache.tiered import TieredCache


def test_every_cache_is_a_store_and_an_admin_store(tmp_path):
    sqlite = ProbeCache(tmp_path / "p.sqlite")
    tiered = TieredCache(MemoryCache(), RedisTier("redis://127.0.0.1:1/0"))
    for cache in (sqlite, MemoryCache(), tiered):
        assert isinstance(cache, Store) and isinstance(cache, AdminStore), cache
    assert not hasattr(type(tiered), "__getattr__")  # the admin API is named, not forwarded
    assert tiered.stats()["entries"] == 0 and tiered.prune(older_than_s=1) == 0
    sqlite.close()
