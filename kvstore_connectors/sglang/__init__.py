"""kvstore as SGLang HiCache's storage backend (docs/sglang.md).

    keys      SGLang page keys -> kvstore block hashes; SGLang's key scheme in Python
    identity  storage config + host pool -> the daemon's namespace
    pages     where a host page lies; zero-copy page <-> region copies
    backend   KVStoreHiCacheStorage, the HiCacheStorage subclass (imports SGLang)

Only ``backend`` imports SGLang, so the rest imports and tests without it.
"""
