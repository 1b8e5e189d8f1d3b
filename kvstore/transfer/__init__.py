"""Peer data movement: NIXL (the transport) and gRPC streaming (the fallback).

``base`` holds the interface, ``nixl_agent`` the NIXL edge (the only module that
imports nixl), ``grpc_stream`` the fallback, ``puller`` the pull protocol.
"""
