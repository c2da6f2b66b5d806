"""What a server computes on shares: exact aggregation, 2PC range checks and robust rounds,
Stage II jobs and their correction tasks, and the store seen as Stage II's ``History``."""
