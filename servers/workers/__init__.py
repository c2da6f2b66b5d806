"""A server as a coordinator and K workers: coordinate shards computed by worker pairs (issue 30)."""
