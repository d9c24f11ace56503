"""KVEventsConfig: where the server publishes its KV cache events, in vLLM's setting
shape (docs/kv-events.md).

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

`endpoint`: the ZMQ PUB socket; an address with `*`, `::`, ipc:// or inproc:// is
bound, any other is connected to (a collector that binds, as vLLM does).
`replay_endpoint`: a ROUTER socket answering requests for missed batches (null: none).
`buffer_steps`: batches kept for replay; `hwm`: the PUB socket's high-water mark
(messages queued per subscriber before ZMQ drops); `max_queue_size`: batches waiting
between the engine thread and the publisher thread before new ones are dropped (and
counted); `topic`: the first frame of every message. Validated once; errors name the
field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.json_setting import json_setting_fields

PUBLISHERS = ("null", "zmq")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """"zmq" or "null" (nothing published); None: "zmq" when events are enabled."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of "
                             f"{', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if name == "replay_endpoint" and value is None:
                continue
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"kv_events_config.{name} must be a ZMQ address such as "
                                 f"tcp://*:5557, got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Events are recorded and sent: enabled, with the zmq publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """Bind `endpoint` (and serve it) rather than connect to a collector."""
        address = self.endpoint
        return ("*" in address or "::" in address
                or address.startswith(("ipc://", "inproc://")))

    @classmethod
    def from_any(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        """A config from itself, a dict of its fields or their JSON text; None, "" or
        "null": no events. Unknown keys are an error naming them."""
        value = json_setting_fields(value, cls, "kv_events_config")
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**value)
