"""Plays a training job's side of a checkpoint-aware drain, in a process of its own.

Uses ``CheckpointSignal`` of deploy/examples/checkpoint_on_drain.py, the shipped example, unchanged:
waits for the actuator's request on its pod, "saves" for ``--save-seconds`` and answers, or never
answers (``--never``). Prints one JSON line per moment (``ready``, ``requested``, ``answered``) with
the wall-clock time, for the test to compare with the eviction.

    python tests/integration/checkpoint_job.py NAMESPACE POD [--save-seconds S | --never]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "checkpoint_on_drain.py"


def say(what: str, **extra: object) -> None:
    print(json.dumps({"event": what, "t": time.time(), **extra}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("namespace")
    parser.add_argument("pod")
    parser.add_argument("--save-seconds", type=float, default=1.0)
    parser.add_argument("--never", action="store_true")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("checkpoint_on_drain", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    signal = example.CheckpointSignal(args.namespace, args.pod)
    say("ready")
    while not signal.wait(1.0):
        pass
    say("requested", message=signal.message)
    if args.never:
        time.sleep(3600)
        return
    time.sleep(args.save_seconds)  # the checkpoint being written
    signal.done(f"saved in {args.save_seconds:g}s")
    say("answered")
    time.sleep(3600)  # keeps running, as a real job would, until the test ends it


if __name__ == "__main__":
    sys.exit(main())
