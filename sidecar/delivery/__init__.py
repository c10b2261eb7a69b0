"""Where data leaves: the ingest client, the per-route delivery policies, and their journals."""
