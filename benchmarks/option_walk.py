"""How far the engine's options travel: the walk of an `EngineConfig` (or any of its groups) from
the server's entry to the model runner, as a reader following it through the code would walk it.

The server's own start-up (`server.api_server.start_client`, what `pagedserve serve` runs before
uvicorn), with the engine core in the server's process so that one profiler sees the whole road
(the default core process receives the same options over a pipe), runs under a profiler that
records every call of a pagedserve function that receives the options (or a group of them) as an
argument, and every read of one of their fields. The walk is the sequence of files of those
events; a *stay* is a run of consecutive events in one file, a *return* a stay in a file the walk
had already left. Fewer stays, files and returns: an option is easier to follow.

    python -m benchmarks.option_walk [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def walk(model: str) -> list[tuple[str, str]]:
    """(file, function) of each call that received the engine's options and of each read of one
    of their fields, in time order."""
    from pagedserve.engine import engine_config
    from pagedserve.server import api_server
    from pagedserve.server.server_config import ServerConfig

    # EngineConfig and the option groups it is made of (after issue 59; before, it was one class).
    kinds = tuple(
        cls
        for cls in vars(engine_config).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and (cls is engine_config.EngineConfig or cls.__name__.endswith("Options"))
    )
    root = str(Path(engine_config.__file__).resolve().parents[1])  # the checkout
    events: list[tuple[str, str]] = []

    def record(frame) -> None:
        path = frame.f_code.co_filename
        if path.startswith(root) and "/benchmarks/" not in path:
            events.append((str(Path(path).relative_to(root)), frame.f_code.co_qualname))

    def profile(frame, event, _arg):
        if event == "call" and any(isinstance(v, kinds) for v in frame.f_locals.values()):
            record(frame)

    def reading(cls: type):
        names = {f.name for f in dataclasses.fields(cls)}
        original = cls.__getattribute__

        def getattribute(self, name):
            if name in names:
                record(sys._getframe(1))
            return original(self, name)

        return original, getattribute

    patched = {cls: reading(cls) for cls in kinds}
    config = engine_config.EngineConfig(model=model)
    for cls, (_, getattribute) in patched.items():
        cls.__getattribute__ = getattribute
    sys.setprofile(profile)
    try:
        client, _description, _core = api_server.start_client(
            config, ServerConfig(core_process=False)
        )
    finally:
        sys.setprofile(None)
        for cls, (original, _) in patched.items():
            cls.__getattribute__ = original
    client.shutdown()
    return events


def summarise(calls: list[tuple[str, str]]) -> dict:
    stays: list[str] = []
    for path, _ in calls:
        if not stays or stays[-1] != path:
            stays.append(path)
    returns = sum(1 for i, path in enumerate(stays) if path in stays[:i])
    return {
        "calls": len(calls),
        "functions": len(set(calls)),
        "files": len(set(stays)),
        "stays": len(stays),
        "returns": returns,
        "walk": stays,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.option_walk", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--walk", action="store_true", help="print the files of the walk too")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = summarise(walk(args.model))
    if not args.walk:
        del result["walk"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
