"""Anthropic's Messages API (`POST /v1/messages`), translated onto the chat path of
server/openai/."""
