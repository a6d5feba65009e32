"""The OpenAPI 3.1 document of the decision API, generated from the models the code validates with."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pipeline.actuator.api.settings import ApiSettings
from pipeline.actuator.requests import MAX_IDEMPOTENCY_KEY_LENGTH, RescueActionBody

RESCUE_ACTIONS_PATH = "/api/v1/rescue-actions"
REQUEST_ID_HEADER = "X-Request-Id"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
API_VERSION = "1.0.0"


class ApiAnswer(BaseModel):
    """Every answer of the rescue-actions endpoint (the seed's body)."""

    code: Literal["Success", "Error"]
    message: str = Field(
        description="'Success', or 'Parameter error: ...', 'Failures to meet preconditions: ...', "
        "'Exceed the maximum plans limit N', 'Unauthorized', 'Service unavailable: ...'"
    )


class Health(BaseModel):
    status: Literal["ok"]


def _component_schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (RescueActionBody, ApiAnswer, Health):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def openapi_document(settings: ApiSettings) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this API."""

    def answer(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        response: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ApiAnswer"}}},
        }
        if headers:
            response["headers"] = headers
        return response

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "xidflow decision API",
            "version": API_VERSION,
            "description": "Third-party systems ask xidflow's actuator to run a plan of actions on a GPU "
            "node. "
            "A request answered Success is durable on Kafka and executed once by some actuator replica.",
        },
        "paths": {
            RESCUE_ACTIONS_PATH: {
                "post": {
                    "operationId": "createRescueActions",
                    "summary": "Queue a rescue plan for one GPU node",
                    "security": [{"bearerAuth": []}],
                    "parameters": [
                        {
                            "name": IDEMPOTENCY_KEY_HEADER,
                            "in": "header",
                            "required": False,
                            "description": "Retries with one key from one client are one request; the key "
                            "reused with a different body is refused (409)",
                            "schema": {
                                "type": "string",
                                "pattern": f"^[\\x21-\\x7e]{{1,{MAX_IDEMPOTENCY_KEY_LENGTH}}}$",
                            },
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RescueActionBody"}}},
                    },
                    "responses": {
                        "200": answer(
                            "Queued: durable on Kafka",
                            {
                                REQUEST_ID_HEADER: {
                                    "description": "Id of the plan (one id for retries with one key)",
                                    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                                }
                            },
                        ),
                        "400": answer("Parameter error: the message names the field"),
                        "401": answer(
                            "Missing or wrong Bearer token",
                            {"WWW-Authenticate": {"schema": {"type": "string"}}},
                        ),
                        "413": answer(f"Body larger than {settings.max_body_bytes} bytes"),
                        "404": answer("Failures to meet preconditions: the node does not exist"),
                        "409": answer(
                            "Failures to meet preconditions: the node is not a GPU node; or the "
                            "Idempotency-Key was already used with a different body"
                        ),
                        "429": answer(f"Exceed the maximum plans limit {settings.max_pending_plans}"),
                        "503": answer("Kafka or the Kubernetes API unreachable; retry with the same Idempotency-Key"),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Serving",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1 document",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": _component_schemas(),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
