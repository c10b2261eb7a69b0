"""The daemon seen from outside: the local status endpoint and its Prometheus rendering."""
