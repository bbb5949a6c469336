"""The server's default limits, in a module light enough for the CLI to import."""

# What a 503 for a full waiting queue tells clients to wait before retrying (seconds).
QUEUE_FULL_RETRY_AFTER_S = 1

# Largest `n` (samples per prompt) accepted by default (--max-n), as the OpenAI API allows.
DEFAULT_MAX_N = 128

# Largest request body accepted by default (--max-request-body-bytes): a 128k-token prompt sent as
# token ids is about 1 MB of JSON, so this leaves room for long chats without letting one client
# make the server buffer gigabytes.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20

# How long a SIGTERM / Ctrl-C lets requests in flight finish before aborting them
# (--shutdown-timeout): under Kubernetes' default grace period of 30 s before its SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
