"""`POST /v1/embeddings`: an embedding model's endpoint."""
