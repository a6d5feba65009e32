"""Third-party rescue requests: the Kingsoft-seed wire format and the record on the requests topic.

The record itself (``RescueActionRequest``) lives in ``schemas.records`` with every other record; it
is re-exported here. A decision system outside xidflow asks for a plan of actions on one node through
``POST /api/v1/rescue-actions`` with the body ``{nodeName, xid, escalateTime, actions: [{name,
waittime}]}``. :func:`parse_rescue_request` validates that body (pure, no I/O) and returns either a
:class:`RescueActionRequest`, the record published to ``gpu.remediation.requests`` keyed by node, or
a :class:`ParameterError` whose message uses the seed's words: ``Parameter error: <field> ...``.

The wire model is strict and closed (unknown fields are refused): a misspelt field in a request that
reboots a node must fail loudly, not be ignored. The record, like every record, ignores unknown
fields on read so that old actuators keep reading newer requests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Final

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic_core import ErrorDetails, PydanticCustomError

from pipeline.actuator.actions import ACTION_NAMES, names
from schemas.records import RescueAction, RescueActionName, RescueActionRequest, stable_id

__all__ = [
    "RESCUE_ACTION_NAMES",
    "ParameterError",
    "RescueAction",
    "RescueActionBody",
    "RescueActionBodyAction",
    "RescueActionName",
    "RescueActionRequest",
    "parse_rescue_request",
]

# From the action registry (which checks that ``RescueActionName`` lists exactly these).
RESCUE_ACTION_NAMES: Final[tuple[str, ...]] = tuple(n for n in ACTION_NAMES if n in names(requestable=True))

MAX_ACTIONS: Final = 16
MAX_WAIT_SECONDS: Final = 7 * 86400
MAX_IDEMPOTENCY_KEY_LENGTH: Final = 255
# Latest instant Python's datetime can hold (9999-12-31T23:59:59Z), as Unix seconds.
_MAX_UNIX_SECONDS: Final = 253402300799
# Kubernetes node names are DNS subdomains (RFC 1123, lowercase), at most 253 characters.
NODE_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_RFC3339 = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})[Tt](?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})(?P<frac>\.\d+)?"
    r"(?P<offset>[Zz]|[+-]\d{2}:\d{2})$"
)
_IDEMPOTENCY_KEY = re.compile(rf"^[\x21-\x7e]{{1,{MAX_IDEMPOTENCY_KEY_LENGTH}}}$")
_MAX_REPORTED_ERRORS: Final = 5


def parse_escalate_time(value: Any) -> datetime:
    """``escalateTime`` as an aware UTC datetime: an RFC 3339 date-time with offset, or Unix seconds."""
    value = integral_number(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= _MAX_UNIX_SECONDS:
            raise PydanticCustomError(
                "escalate_time", "must be Unix seconds between 0 and {max}", {"max": _MAX_UNIX_SECONDS}
            )
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str) and (match := _RFC3339.match(value)):
        # RFC 3339 allows a leap second (:60); datetime does not, so it is read as :59.
        seconds = "59" if match["s"] == "60" else match["s"]
        offset = "+00:00" if match["offset"] in ("Z", "z") else match["offset"]
        text = f"{match['date']}T{match['h']}:{match['m']}:{seconds}{match['frac'] or ''}{offset}"
        try:
            local = datetime.fromisoformat(text)
        except ValueError:
            local = None  # not a real date-time (month 13, Feb 30, offset 25:00)
        if local is not None:
            try:
                return local.astimezone(UTC)
            except (ValueError, OverflowError):
                # A real date-time whose instant falls outside the years 1 to 9999 in UTC (0001-01-01T00:30+01:00):
                # no datetime holds it. JSON Schema's date-time allows it; the documented range does not.
                raise PydanticCustomError(
                    "escalate_time", "must be an instant within the years 1 to 9999 in UTC ({value} is outside)",
                    {"value": value},
                ) from None
    raise PydanticCustomError(
        "escalate_time", "must be an RFC 3339 date-time with an offset (2024-07-04T11:09:40Z) or Unix seconds"
    )


def integral_number(value: Any) -> Any:
    """JSON Schema's ``integer`` includes ``5.0``: pass integral floats on as ints, all else unchanged."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Strict (no "79" strings, no booleans) yet faithful to JSON Schema, where 79.0 is an integer.
JsonInt = Annotated[int, BeforeValidator(integral_number)]

EscalateTime = Annotated[
    datetime,
    # A before-validator (not a plain one): pydantic then serialises the datetime it returns normally.
    BeforeValidator(parse_escalate_time),
    WithJsonSchema(
        {
            "description": "When the third party escalated the fault: RFC 3339 date-time with an offset whose "
            "instant lies within the years 1 to 9999 in UTC (0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z), "
            "or Unix seconds",
            "oneOf": [
                {"type": "string", "format": "date-time"},
                {"type": "integer", "minimum": 0, "maximum": _MAX_UNIX_SECONDS},
            ],
        }
    ),
]


class RescueActionBodyAction(BaseModel):
    """One step of a requested plan, as it arrives on the wire."""

    model_config = ConfigDict(extra="forbid", strict=True, title="RescueAction")

    name: RescueActionName = Field(description="What to do to the node")
    waittime: JsonInt = Field(
        default=0,
        ge=0,
        le=MAX_WAIT_SECONDS,
        description="Seconds the actuator waits after this action before it starts the next one",
    )


class RescueActionBody(BaseModel):
    """The body of ``POST /api/v1/rescue-actions`` (the Kingsoft seed's format)."""

    model_config = ConfigDict(extra="forbid", strict=True, title="RescueActionRequestBody")

    node_name: str = Field(
        alias="nodeName",
        min_length=1,
        max_length=253,
        pattern=NODE_NAME_PATTERN,
        description="Kubernetes node name",
    )
    xid: JsonInt = Field(ge=1, le=2**31 - 1, description="The Xid (or SXid) code the plan answers")
    escalate_time: EscalateTime = Field(alias="escalateTime")
    actions: list[RescueActionBodyAction] = Field(
        min_length=1, max_length=MAX_ACTIONS, description="Actions executed in order"
    )


@dataclass(frozen=True, slots=True)
class ParameterError:
    """Why a request body was refused, in the seed's words (``Parameter error: ...``)."""

    message: str


class _RepeatedKey(ValueError):
    pass


def _refuse_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)


def repeated_key(body: bytes | str) -> str | None:
    """A key that appears twice in one object of the JSON ``body``, or None (also when it is no JSON at all:
    the model's validation then says why). JSON leaves which of two values counts to the reader, and readers
    differ (ours took the last): such a body is refused rather than read one way here and another elsewhere."""
    try:
        json.loads(body, object_pairs_hook=_refuse_repeats)
    except _RepeatedKey as exc:
        return str(exc.args[0])
    except (ValueError, RecursionError):
        return None
    return None


def rescue_request_id(
    body: RescueActionBody, *, received_at: datetime, requested_by: str, idempotency_key: str | None
) -> str:
    """The request id: retries carrying one ``Idempotency-Key`` from one client share it."""
    if idempotency_key is not None:
        # Scoped by client so that two clients that pick the same key are still two requests.
        return stable_id("rescue-request", "key", requested_by, idempotency_key)
    canonical = orjson.dumps(body.model_dump(mode="json", by_alias=True), option=orjson.OPT_SORT_KEYS)
    return stable_id("rescue-request", "body", requested_by, canonical.decode(), received_at.isoformat())


def parse_rescue_request(
    body: bytes | str,
    *,
    received_at: datetime,
    requested_by: str,
    idempotency_key: str | None = None,
) -> RescueActionRequest | ParameterError:
    """Validate a seed-format request body; the request, or the error naming every bad field."""
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.match(idempotency_key):
        return ParameterError(
            f"Parameter error: Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} "
            "printable ASCII characters without spaces"
        )
    if (key := repeated_key(body)) is not None:
        return ParameterError(
            f"Parameter error: body has the key {key[:100]!r} twice in one object; send each key once"
        )
    try:
        wire = RescueActionBody.model_validate_json(body)
    except ValidationError as exc:
        problems = [describe_error(error) for error in exc.errors(include_url=False)]
        shown = problems[:_MAX_REPORTED_ERRORS]
        if len(problems) > len(shown):
            shown.append(f"and {len(problems) - len(shown)} more")
        return ParameterError("Parameter error: " + "; ".join(shown))
    if received_at.tzinfo is None:
        received_at = received_at.replace(tzinfo=UTC)
    return RescueActionRequest(
        request_id=rescue_request_id(
            wire, received_at=received_at, requested_by=requested_by, idempotency_key=idempotency_key
        ),
        node_name=wire.node_name,
        xid=wire.xid,
        escalate_time=wire.escalate_time,
        actions=[RescueAction(name=a.name, waittime=a.waittime) for a in wire.actions],
        received_at=received_at,
        requested_by=requested_by,
        idempotency_key=idempotency_key,
    )


def field_path(loc: tuple[int | str, ...]) -> str:
    """``('actions', 0, 'name')`` -> ``actions[0].name``; the empty location is the body itself."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def describe_error(error: ErrorDetails) -> str:
    """One pydantic error as ``<field> <what is wrong>``, in words a client can act on."""
    field = field_path(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "json_invalid":
        return "body is not valid JSON"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{field} must be a JSON object"
    if kind == "missing":
        return f"{field} is required"
    if kind == "extra_forbidden":
        return f"{field} is not a known field"
    if kind == "literal_error":
        return f"{field} must be one of {', '.join(RESCUE_ACTION_NAMES)}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{field} must be an integer"
    if kind == "string_type":
        return f"{field} must be a string"
    if kind == "list_type":
        return f"{field} must be an array"
    if kind == "greater_than_equal":
        return f"{field} must be >= {ctx['ge']}"
    if kind == "less_than_equal":
        return f"{field} must be <= {ctx['le']}"
    if kind == "string_too_short":
        return f"{field} must not be empty"
    if kind == "string_too_long":
        return f"{field} must be at most {ctx['max_length']} characters"
    if kind == "string_pattern_mismatch":
        return f"{field} must be a Kubernetes node name (lowercase RFC 1123 subdomain)"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return f"{field} must not be empty"
    if kind == "too_short":
        return f"{field} must have at least {ctx['min_length']} items"
    if kind == "too_long":
        return f"{field} must have at most {ctx['max_length']} items"
    return f"{field} {error['msg']}"
