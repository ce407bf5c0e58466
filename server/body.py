"""Strict parsing of JSON request bodies into pydantic models.

Python's ``json`` module accepts ``NaN``, ``Infinity`` and ``1e999`` (which
overflows to ``inf``) and lone UTF-16 surrogates; none of these is valid JSON
for an API and each would reach the sampler as garbage, so they are refused
here with a 400 before any model validation runs.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from server.errors import ClientDisconnected, bad_request, validation_message

ModelT = TypeVar("ModelT", bound=BaseModel)


class _InvalidJSON(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _InvalidJSON(f"{name} is not valid JSON; send a finite number")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _InvalidJSON(f"number {text} is out of range")
    return value


def _check_strings(value: Any, path: str = "") -> None:
    """Raise on any string (key or value) that is not valid Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            where = path or "body"
            raise _InvalidJSON(f"{where} contains a lone surrogate (invalid Unicode)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}[{i}]")


def parse_json(raw: bytes) -> dict[str, Any]:
    """Parse a request body as strict JSON; it must be an object."""
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float)
        _check_strings(obj)
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.") from None
    except _InvalidJSON as e:
        raise bad_request(f"Invalid JSON: {e}.") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"Invalid JSON: {e.msg} at line {e.lineno} column {e.colno}.") from None
    except ValueError as e:  # e.g. an integer with more digits than Python parses
        raise bad_request(f"Invalid JSON: {e}.") from None
    except RecursionError:
        raise bad_request("Invalid JSON: nested too deeply.") from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.")
    return obj


def validate(model: type[ModelT], obj: dict[str, Any]) -> ModelT:
    """Validate a parsed body; pydantic errors become a 400 naming the field."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(e)
        raise bad_request(message, param) from None


async def read_model(request: Request, model: type[ModelT]) -> ModelT:
    """Read, parse and validate the body of ``request`` as ``model``."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return validate(model, parse_json(raw))
