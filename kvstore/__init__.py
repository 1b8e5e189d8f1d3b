"""kvstore: a distributed KV-cache service for LLM inference."""

__version__ = "0.1.0"
