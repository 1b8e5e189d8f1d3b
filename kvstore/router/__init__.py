"""`kvstore router`: the OpenAI-compatible HTTP proxy built on kvstore_router_client.

Modules: ``backends`` (the engines: sessions, health, scraped load), ``upstream``
(the lean HTTP/1.1 client of the forwarded request), ``proxy`` (the HTTP app and
the per-request path), ``metrics`` (``kvstore_router_*``), ``cli``. Dependencies
point one way: this package imports kvstore_router_client, kvstore.config /
errors / hashing, aiohttp and httptools, never the daemon's internals.
"""
