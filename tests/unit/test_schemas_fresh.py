"""The committed JSON Schema files must match what the models render."""

from __future__ import annotations

from schemas.generate import JSON_DIR, rendered


def test_schema_files_are_fresh() -> None:
    expected = rendered()
    on_disk = {p.name: p.read_bytes() for p in JSON_DIR.glob("*.json")}
    stale = sorted(name for name in expected if on_disk.get(name) != expected[name])
    extra = sorted(set(on_disk) - set(expected))
    assert not stale and not extra, (
        f"stale: {stale}, unexpected: {extra}; run `python -m schemas.generate` and commit the result"
    )
