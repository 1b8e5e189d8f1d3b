"""kvstore behind LMCache (docs/lmcache.md).

    keys     LMCache keys -> namespace (model, rank, layout, tenant) + block hash
    blocks   one chunk in one slot: header + LMCache's metadata + bytes
    store    the daemon link: chunks in and out, misses on failure (no LMCache import)
    remote   KVStoreConnectorAdapter / KVStoreConnector, LMCache's in-process
             remote backend (imports LMCache)

Only ``remote`` imports LMCache; the rest imports and tests without it.
"""
