"""Request schemas of the HTTP API (pydantic lives only here, at the edge)."""
