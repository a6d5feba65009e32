"""A worker's start imports no aiohttp, and a later use of aiohttp still gets the real one.

Why: aiohttp is imported by Faust only to name a type alias (``faust.types.web``) and to resolve its
``HttpClient`` setting, yet its import was ~0.13 s of CPU before a restarted worker could fork its
child (issue 22, ``failover_worker_process``). ``pipeline.kafka.upstream.import_faust_types`` and
``aiohttp_session`` keep it out; these checks run in a fresh interpreter, since the test process may
have imported aiohttp already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The worker command up to the point where it needs Kafka (a refused connection ends it there), then what
# it and its child import after that: the supervisor's preload and the Faust app the child builds.
_WORKER_START = """
import asyncio, json, sys
from click.testing import CliRunner
from pipeline.commands.worker import WORKER_MODULES, worker
result = CliRunner().invoke(worker, ["--bootstrap", "127.0.0.1:1", "--no-supervise"])
from pipeline.runtime import supervisor
supervisor.preload(WORKER_MODULES)
from agents.worker import create_app
from pipeline.app import WorkerSettings
from pipeline.runtime.settings import TopicNames
xapp = create_app("127.0.0.1:1", WorkerSettings(), TopicNames())
loaded = sorted(m for m in sys.modules if m == "aiohttp" or m.startswith("aiohttp."))

async def session_type():
    session = xapp.app.http_client  # what a Faust feature that makes HTTP requests would get
    try:
        return type(session).__module__ + "." + type(session).__qualname__
    finally:
        await session.close()

print(json.dumps({"exit": result.exit_code, "output": result.output, "aiohttp": loaded,
                  "session": asyncio.run(session_type())}))
"""


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_worker_start_imports_no_aiohttp_and_http_client_is_real() -> None:
    out = _run(_WORKER_START)
    assert out["exit"] == 1 and "cannot reach Kafka" in out["output"], out["output"]
    assert out["aiohttp"] == [], f"the worker's start imported {out['aiohttp'][:5]}"
    assert out["session"] == "aiohttp.client.ClientSession"


def test_aiohttp_imported_after_faust_types_is_the_real_one() -> None:
    out = _run(
        "import json, sys\n"
        "from pipeline.kafka import upstream\n"
        "upstream.import_faust_types()\n"
        "import faust.types.web\n"
        "from aiohttp.client import ClientSession\n"
        "import aiohttp\n"
        "print(json.dumps({'real': ClientSession is aiohttp.ClientSession and hasattr(aiohttp.client, 'request'),"
        " 'alias_is_stand_in': faust.types.web.HttpClientT is not ClientSession}))\n"
    )
    assert out == {"real": True, "alias_is_stand_in": True}
