"""The trace simulator: a discrete-event model of engines in several regions and the Mooncake trace it
replays (``kvgate simulate`` routes it with the gateway's Router).
"""
