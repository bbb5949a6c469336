"""`GET /metrics`: pagedserve's Prometheus families and vLLM's names beside them."""
