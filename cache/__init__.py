"""The shared vocabulary of "what KV is where": block hashes, residency, sessions, KV events, tokens."""
