"""`ft serve`: the HTTP API process, the engine process, and the supervisor between them."""
