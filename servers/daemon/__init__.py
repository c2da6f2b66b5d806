"""The server daemon: the client API, FL rounds with the peer, unlearning jobs, the peer link."""
