"""The embedded model's folder with a Hermes-style chat template (as Qwen2.5's renders
tools, tool calls and tool results; written for these tests), so that the server renders
tools and reads <tool_call> blocks on a model the tests can run."""

from __future__ import annotations

import tempfile
from pathlib import Path

from zmqworker.models.embedded import default_model_path

TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def hermes_model(parent: str | None = None) -> str:
    """A folder that links the embedded model's files, with TEMPLATE as its chat template."""
    source = Path(default_model_path(progress=False))
    folder = Path(tempfile.mkdtemp(prefix="hermes-model-", dir=parent))
    for item in source.iterdir():
        if item.name != "chat_template.jinja":
            (folder / item.name).symlink_to(item)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return str(folder)
