"""The per-agent worker process (``worker --agent NAME``)."""
