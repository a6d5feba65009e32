"""The worker writes nothing into its working directory (a checkout, or a read-only image root)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agents.worker import create_app


def test_faust_directories_are_not_created_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    xapp = create_app("127.0.0.1:1")
    asyncio.run(xapp.app.on_first_start())  # where Faust creates its data, app and table directories
    assert list(cwd.iterdir()) == []
    assert Path(xapp.app.conf.datadir).is_absolute()
