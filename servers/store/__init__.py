"""The server's durable store: committed rounds, staging, job records, erasure, crash recovery."""
