"""Who pays: tenants and API keys, rate limits, prices, per-request accounting, the ledger writer and the
usage API.
"""
