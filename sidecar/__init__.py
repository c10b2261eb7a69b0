"""sidecar: forwards a training job to the platform's ingest API."""

__version__ = "0.1.0"
