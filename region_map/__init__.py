"""Topology: regions, their engines, the latency between them, and the engines' live health and load."""
