"""What a run keeps: the durable journal and what is read from it (status, report, logs)."""
