"""The Python examples of README.md's "Serve it" section run as written against real servers:
port 8000 is the session's SmolLM2 server, port 8001 the embedding server (the README starts it
so). The blocks run in order in one namespace, as a reader pasting them one after another would;
what they print is checked for the facts it shows. (The LoRA example runs in test_lora.py.)"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.server.util import token_count

ROOT = Path(__file__).resolve().parents[2]


# The LoRA example's server (port 8002) is tests/server/test_lora.py's: it runs the example there.
LORA_PORT = "127.0.0.1:8002"


def serve_it_examples() -> list[str]:
    """The Python blocks of README.md's "Serve it" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Serve it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _serve_it_examples() -> list[str]:
    return [block for block in serve_it_examples() if LORA_PORT not in block]


def test_the_serve_it_examples_run_as_written(server, embedding_server):
    blocks = _serve_it_examples()
    # The chat and stream example, structured outputs, the Responses API, the Messages API,
    # embeddings.
    assert len(blocks) == 5, [b.splitlines()[0] for b in blocks]
    namespace: dict = {}
    printed = io.StringIO()
    for block in blocks:
        code = block.replace("http://127.0.0.1:8000", server.base_url).replace(
            "http://127.0.0.1:8001", embedding_server.base_url
        )
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own
    assert "Paris" in namespace["chat"].choices[0].message.content
    assert namespace["city"].model_dump().keys() == {"name", "country"}
    assert namespace["first"].status == namespace["second"].status == "completed"
    assert namespace["second"].previous_response_id == namespace["first"].id
    assert "Paris" in namespace["first"].output_text
    # Anthropic's SDK sends no temperature (the server's default, 1, as Anthropic's): the
    # message is a sample, so its shape is what holds.
    message = namespace["message"]
    assert message.content[0].type == "text" and 1 <= message.usage.output_tokens <= 32
    assert message.stop_reason == (
        "max_tokens" if message.usage.output_tokens == 32 else "end_turn"
    )
    assert namespace["tokens"].input_tokens == token_count(
        server, messages=namespace["conversation"]
    )
    result = namespace["result"]
    assert (len(result.data), len(result.data[0].embedding)) == (2, 384)
    # The last line printed: the embeddings' count, size and prompt tokens.
    assert printed.getvalue().rstrip().splitlines()[-1] == f"2 384 {result.usage.prompt_tokens}"
