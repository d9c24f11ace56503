"""What ranks 1..N-1 of a tensor-parallel server do: no HTTP, only compute.

    torchrun --nproc-per-node 3 -m server --config configs/tp.yaml

starts three processes. Rank 0 serves HTTP and runs the engine's scheduler; every
other rank loads its shard of the model, builds the same manager (so the collective
set-up calls match) and runs the driver's step plans until the driver's engine stops,
then exits 0. Signals do not stop a follower: torchrun forwards SIGTERM to every rank,
and a follower leaving early would leave the driver unable to finish the requests it
is draining. A follower whose driver vanished fails on the control group's timeout.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

from .settings import ServerSettings

logger = logging.getLogger(__name__)


def _wait_for_driver(sig: int, frame: FrameType | None) -> None:
    logger.info("received %s: this rank stops when the driver rank has drained",
                signal.Signals(sig).name)


def follow_driver(settings: ServerSettings, model: Any) -> None:
    """Run this follower rank's share of every step until the driver stops."""
    from .app import init_manager

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _wait_for_driver)
    manager = init_manager(settings, model)
    manager.start()
    logger.info("rank %d of %d: following the driver's steps", model.tp_group.rank,
                model.tp_group.world_size)
    manager.join()
    error = manager.loop.error
    manager.destroy()
    if error is not None:
        raise SystemExit(f"kvserve: rank {model.tp_group.rank} lost the driver rank: {error!r}")
