"""Write the JSON Schema of every record model into ``schemas/json/`` for downstream consumers.

Run ``python -m schemas.generate`` after changing a model; ``tests/unit/test_schemas_fresh.py``
fails while the committed files are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from schemas.records import ALL_RECORDS

JSON_DIR = Path(__file__).parent / "json"


def rendered() -> dict[str, bytes]:
    """File name -> exact bytes of each schema file."""
    out: dict[str, bytes] = {}
    for model in ALL_RECORDS:
        schema = model.model_json_schema(mode="serialization")
        schema["$id"] = f"https://xidflow.dev/schemas/{model.__name__}.json"
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[f"{model.__name__}.json"] = orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    return out


def main() -> int:
    JSON_DIR.mkdir(exist_ok=True)
    for name, data in rendered().items():
        (JSON_DIR / name).write_bytes(data)
        print(f"wrote schemas/json/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
