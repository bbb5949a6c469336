"""`POST /v1/audio/transcriptions`: a Whisper model's endpoint and its response formats."""
