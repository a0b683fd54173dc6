"""A shared Redis tier behind the local store: ``TE_FL_ATTN_REMOTE_CACHE=redis://host:port/db``.

:class:`.tiered.TieredCache` reads the local store first, then Redis (hits are written back to
the local store), and writes new results to both. Redis keys carry a prefix,
:data:`FORMAT_VERSION` and every :class:`CacheKey` field (whose ``versions_key`` already folds
in the software stack, this package's version and the probe schema), so a key is only ever
served to the rows it was probed for. Values are JSON (:meth:`ProbeResult.to_dict`), never
pickle.

Layout (``P`` = ``<prefix>:v<FORMAT_VERSION>``):

* ``P:r:<config_key>:<backend>:<device_fp>:<versions_key>`` -> the result JSON;
* ``P:ctx:<device_fp>:<versions_key>`` -> ``{"device", "package_version", "created_at"}``;
* ``P:cfg:<config_key>`` (hash) -> ``_config``: the config JSON, ``<device_fp>:<versions_key>``:
  ``1`` for every context that stored a result for the config (what fleet plans look up).

Every value read from Redis is checked by the cache's one row validator
(:func:`.rows.validate_result`, :func:`.rows.validate_context`,
:func:`.rows.validate_flat`; values over :data:`.rows.MAX_ROW` bytes are refused unread):
a value that fails is a miss, counted in ``stats["bad"]``, with one warning.

Redis unreachable, slow (1 s timeouts) or answering garbage: a miss, one warning on
``te_fl_attention.cache``, and the tier stays off for the rest of the cache's life (the process
default cache lives as long as the process). Selection never fails because of Redis.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from typing import Any

from ..reasons import ProbeResult
from .keys import CacheKey, is_hex64, known_backends
from .rows import MAX_ROW, CacheRow, validate_context, validate_flat, validate_result

log = logging.getLogger("te_fl_attention.cache")

#: Bump when the Redis key layout or value format changes (old entries are then ignored).
FORMAT_VERSION = 1
DEFAULT_PREFIX = "te-fl-attn"
DEFAULT_TIMEOUT_S = 1.0
_CHUNK = 512
_CONFIG_FIELD = "_config"
_dumps = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def redact(url: str) -> str:
    """The URL without its password (for log messages)."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def _loads(raw: Any) -> Any:
    """A Redis value parsed as JSON; ``None`` for no value, non-text, over-long or bad JSON."""
    if raw is None or not isinstance(raw, (bytes, str)) or len(raw) > MAX_ROW:
        return None
    try:
        return json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return None


class RedisTier:
    """Probe results in Redis (see the module docstring). Never raises on a Redis problem."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_TIMEOUT_S, client: Any = None) -> None:  # fmt: skip
        self.url = url
        self.ns = f"{prefix}:v{FORMAT_VERSION}"
        self.timeout_s = timeout_s
        self._client = client
        self.disabled = False
        self.stats = {"gets": 0, "hits": 0, "puts": 0, "errors": 0, "bad": 0}
        self._known_ctx: dict[tuple[str, str], dict[str, Any]] = {}

    def __repr__(self) -> str:
        state = "off" if self.disabled else "on"
        return f"RedisTier({redact(self.url)!r}, {state})"

    # ------------------------------------------------------------------ keys
    def key(self, k: CacheKey) -> str:
        return f"{self.ns}:r:{k.config_key}:{k.backend}:{k.device_fp}:{k.versions_key}"

    def _ctx_key(self, fp: str, vk: str) -> str:
        return f"{self.ns}:ctx:{fp}:{vk}"

    def _cfg_key(self, config_key: str) -> str:
        return f"{self.ns}:cfg:{config_key}"

    # ------------------------------------------------------------------ plumbing
    def _connect(self) -> Any:
        if self._client is None:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._client = redis.Redis.from_url(
                self.url, socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
            )  # fmt: skip
        return self._client

    def _call(self, fn: Any, miss: Any) -> Any:
        """``fn(client)``; any failure disables the tier (one warning) and returns ``miss``."""
        if self.disabled:
            return miss
        try:
            return fn(self._connect())
        except Exception as exc:  # noqa: BLE001 - redis, socket, import or protocol errors
            self.disable(exc)
            return miss

    def disable(self, exc: BaseException | str) -> None:
        """Turn the tier off for the rest of this object's life, with one warning."""
        self.stats["errors"] += 1
        if not self.disabled:
            self.disabled = True
            why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ImportError):
                why += " (pip install 'te-fl-attention[redis]')"
            log.warning("remote probe cache %s is unavailable (%s); it is off for this process, "
                        "results stay local", redact(self.url), why)  # fmt: skip

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ reads
    def _bad(self, where: str, why: str) -> None:
        """Count a value that failed validation; warn once per tier."""
        self.stats["bad"] += 1
        if self.stats["bad"] == 1:
            log.warning("remote probe cache %s: ignoring an invalid value at %s (%s); such "
                        "values are misses", redact(self.url), where[:200], why[:200])  # fmt: skip
        else:
            log.debug("remote probe cache: ignoring an invalid value at %s (%s)", where, why)

    def _decode(self, key: CacheKey, raw: Any) -> ProbeResult | None:
        d = _loads(raw)
        if d is None:
            size = len(raw) if isinstance(raw, (bytes, str)) else 0
            why = f"{size} bytes (limit {MAX_ROW})" if size > MAX_ROW else "not JSON"
            self._bad(self.key(key), why)
            return None
        checked = validate_result(d, key.backend)
        if isinstance(checked, str):
            self._bad(self.key(key), checked)
            return None
        try:
            return ProbeResult.from_dict(checked)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            self._bad(self.key(key), f"{type(exc).__name__}: {exc}")
            return None

    def get_many(self, keys: Iterable[CacheKey]) -> dict[CacheKey, ProbeResult]:
        """The hits among ``keys`` (one ``MGET`` per 512 keys)."""
        keys = [CacheKey(*k) for k in keys]
        if not keys or self.disabled:
            return {}
        self.stats["gets"] += len(keys)

        def read(client: Any) -> list[Any]:
            values: list[Any] = []
            for i in range(0, len(keys), _CHUNK):
                values += client.mget([self.key(k) for k in keys[i:i + _CHUNK]])
            return values

        values = self._call(read, miss=[None] * len(keys))
        out = {}
        for k, raw in zip(keys, values, strict=False):
            hit = self._decode(k, raw) if raw is not None else None
            if hit is not None:
                out[k] = hit
        self.stats["hits"] += len(out)
        return out

    def contexts(self, pairs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
        """``{(device_fp, versions_key): {"device", "package_version", "created_at"}}``."""
        want = [p for p in dict.fromkeys(pairs) if p not in self._known_ctx]
        if want and not self.disabled:
            raws = self._call(lambda c: c.mget([self._ctx_key(*p) for p in want]), miss=[])
            for p, raw in zip(want, raws, strict=False):
                if raw is None:
                    continue
                meta = validate_context(_loads(raw))
                if isinstance(meta, str):
                    self._bad(self._ctx_key(*p), meta)
                else:
                    self._known_ctx[p] = meta
        return {p: self._known_ctx[p] for p in pairs if p in self._known_ctx}

    def config_json(self, config_keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The stored config JSON of each config key (where one was stored)."""
        cks = list(dict.fromkeys(config_keys))
        if not cks or self.disabled:
            return {}

        def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for ck in cks:
                pipe.hget(self._cfg_key(ck), _CONFIG_FIELD)
            return pipe.execute()

        out = {}
        for ck, raw in zip(cks, self._call(read, miss=[]), strict=False):
            if raw is None:
                continue
            d = validate_flat(_loads(raw), "config")
            if isinstance(d, dict):
                out[ck] = d
            else:
                self._bad(self._cfg_key(ck), d or "not a JSON object")
        return out

    def rows_for_config(self, config_key: str) -> list[CacheRow]:
        """Every stored row of one config, from every device and software stack."""
        if self.disabled or not is_hex64(config_key):
            return []
        fields = self._call(lambda c: c.hkeys(self._cfg_key(config_key)), miss=[])
        pairs = []
        for f in fields:
            fp, _, vk = (f.decode() if isinstance(f, bytes) else str(f)).partition(":")
            if is_hex64(fp) and is_hex64(vk):
                pairs.append((fp, vk))
        keys = [CacheKey(config_key, b, fp, vk) for fp, vk in pairs
                for b in known_backends()]  # fmt: skip
        hits = self.get_many(keys)
        metas = self.contexts(pairs)
        config = self.config_json([config_key]).get(config_key)
        rows = []
        for k, result in hits.items():
            meta = metas.get((k.device_fp, k.versions_key), {})
            rows.append(CacheRow(k, result.to_dict(), float(meta.get("created_at") or 0.0),
                                 str(meta.get("package_version") or ""), config,
                                 meta.get("device")))  # fmt: skip
        return rows

    # ------------------------------------------------------------------ writes
    def put_many(self, rows: Iterable[CacheRow], *, only_new: bool = False) -> int:
        """Write rows (``only_new``: keep values already there); returns how many were sent."""
        rows = list(rows)
        if not rows or self.disabled:
            return 0
        now = time.time()

        def write(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            new_ctx: dict[tuple[str, str], dict[str, Any]] = {}
            for row in rows:
                k = row.key
                pipe.set(self.key(k), _dumps(dict(row.result)), nx=only_new)
                fields = {f"{k.device_fp}:{k.versions_key}": "1"}
                if row.config is not None:
                    fields[_CONFIG_FIELD] = _dumps(dict(row.config))
                pipe.hset(self._cfg_key(k.config_key), mapping=fields)
                pair = (k.device_fp, k.versions_key)
                if pair not in self._known_ctx and (row.device is not None or pair not in new_ctx):
                    new_ctx[pair] = {"device": dict(row.device) if row.device else None,
                                     "package_version": row.package_version,
                                     "created_at": row.created_at or now}  # fmt: skip
            for pair, meta in new_ctx.items():
                pipe.set(self._ctx_key(*pair), _dumps(meta), nx=True)
            pipe.execute()
            self._known_ctx.update((p, m) for p, m in new_ctx.items() if m["device"])
            return len(rows)

        n = self._call(write, miss=0)
        self.stats["puts"] += n
        return n


def remote_tier(url: str) -> RedisTier:
    """The tier for ``TE_FL_ATTN_REMOTE_CACHE``'s URL (an unusable URL: a disabled tier, with
    one warning)."""
    tier = RedisTier(url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        tier.disable(f"TE_FL_ATTN_REMOTE_CACHE={redact(url)!r} is not a redis://, rediss:// or "
                     "unix:// URL")  # fmt: skip
    return tier
