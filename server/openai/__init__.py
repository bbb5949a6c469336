"""OpenAI's API: completions, chat completions and Responses, with what shapes their answers
(tool calls, reasoning, structured outputs, fill-in-the-middle prompts)."""
