"""The cluster indexer: which node holds which prefix, in which tier.

backend.py      IndexBackend protocol, NodeScore, the numpy prefix scorer
memory.py       in-process index (open addressing over numpy arrays)
redis_index.py  Redis/Valkey index (shared by replicas, survives restarts)
mirror.py       Redis index read through a local in-memory copy
subscriber.py   follows daemon / vLLM engine KV event streams over ZMQ
service.py      Indexer (domain) + gRPC IndexerService
config.py       IndexerConfig
cli.py          ``kvstore indexer`` (add_arguments / run / main)
"""
