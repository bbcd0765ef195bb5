"""Watching the gateway: Prometheus metrics, event-loop metrics, JSON logs, the dashboard and the operator's
endpoints.
"""
