"""`python -m server ...`: parse settings, load the model, serve until interrupted.

The model is loaded before uvicorn starts, so a bad setting or an unloadable model
ends the process with one clear line and a non-zero status instead of a traceback.
SIGTERM or Ctrl-C drain the requests in flight and exit 0 (see lifecycle.py).
Under tensor parallelism (torchrun, `--tp-size N`) rank 0 serves and the other
ranks run follower.py.
"""

from __future__ import annotations

import logging
import os
import sys

from .cli import parse_settings
from .memory import cap_malloc_arenas
from .settings import SettingsError


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    try:
        cap_cpu_isa(settings.cpu_isa)   # before anything imports torch's kernels
    except ValueError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    # Imported late: `--help` and setting errors stay instant.
    from .app import create_app, load_engine_model
    from .edge.lifecycle import serve

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != settings.tp_size:
        print(f"kvserve: tp_size is {settings.tp_size} but {world_size} processes were "
              f"started: launch with `torchrun --nproc-per-node {settings.tp_size} -m server`"
              if settings.tp_size > 1 else
              f"kvserve: started as one of {world_size} processes but tp_size is 1: "
              f"set --tp-size {world_size}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:  %(message)s")
    cap_malloc_arenas(settings.malloc_arena_max)    # before the threads start
    try:
        model = load_engine_model(settings)
    except Exception as exc:  # any loader failure: missing file, offline hub, bad weights
        print(f"kvserve: cannot load model {settings.model!r}: {exc}", file=sys.stderr)
        return 1
    if model.tp_group is not None and not model.tp_group.is_driver:
        from .follower import follow_driver

        follow_driver(settings, model)
        return 0
    serve(create_app(settings, model), settings)
    return 0


def cap_cpu_isa(name: str) -> None:
    """Run the kernels of ISA level `name` ("native": the CPU's best); below the
    CPU's best, torch's own CPU kernels are held to the level too."""
    from engine.kernels.isa import cap_torch, cpu_features, choose_level

    os.environ["KVSERVE_CPU_ISA"] = name
    features = cpu_features()
    level, best = choose_level(features, name), choose_level(features)
    if level != best:
        cap_torch(level)


if __name__ == "__main__":
    sys.exit(main())
