"""Ingest: the first stage. Validate what an agent sends, store it durably (group commit), answer
with the run's pending commands, and hand the batch to the closed loop (``service/loop``)."""
