"""Shared state: the in-process view of residency and sessions, its Redis mirror and background writer, and
the engines' KV event followers (HTTP and ZMQ).
"""
