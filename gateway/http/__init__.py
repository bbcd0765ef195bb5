"""The edge towards clients and engines: HTTP servers with the edge's read deadlines, the upstream client
pool, relaying answers and SSE, the engine kinds' request bodies and P/D protocols, errors.
"""
