"""Earlier turns' tool calls, as the prompt gives them back to the model.

The generic format writes an assistant turn's ``tool_calls`` as its content
(``history_content``); the native formats hand them to the chat template
(``template_tool_calls``), which writes them its own way.
"""

from __future__ import annotations

import json
from typing import Any


def _arguments_value(arguments: Any) -> Any:
    # OpenAI sends arguments as a JSON string; templates want the object.
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def history_content(tool_calls: list[dict[str, Any]], parallel: bool) -> str:
    """An earlier assistant turn's ``tool_calls`` as the text the generic format gives them."""
    calls = [{"name": c["function"]["name"], "arguments": _arguments_value(c["function"]["arguments"])}
             for c in tool_calls]
    value: Any = calls if parallel or len(calls) > 1 else calls[0]
    return json.dumps(value, ensure_ascii=False)


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An earlier assistant turn's ``tool_calls`` as chat templates read them (arguments as objects)."""
    return [{"id": c.get("id"), "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": _arguments_value(c["function"]["arguments"])}}
            for c in tool_calls]
