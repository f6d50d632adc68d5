"""What the server knows about its clients: sessions, training models, samplers, checkpoints.

Ids follow the SDK's conventions: a training model is ``<session>:train:<n>`` (what the SDK
itself derives when it creates a client from a checkpoint), a sampler
``<session>:sample:<n>``, and a checkpoint's path ``tinker://<model id>/weights/<name>``
(training state) or ``tinker://<model id>/sampler_weights/<name>`` (an adapter for sampling);
checkpoint files live under ``<checkpoint root>/<model id>/<kind>/<name>``. Plain data only:
the handlers and the trainer do the work.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from palaestra.tinker_api.errors import ApiError, not_found
from palaestra.tinker_api.trainer import LoraSpec

KIND_DIRS = {"training": "weights", "sampler": "sampler_weights"}


@dataclass
class Session:
    session_id: str
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: str | None = None  # the finish reason, once finished
    sampler_clients: int = 0  # join_sampling_session's counter


@dataclass
class Checkpoint:
    """A saved checkpoint (``kind`` "training" or "sampler")."""

    model_id: str
    kind: str
    name: str
    directory: Path
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    user_metadata: dict[str, str] | None = None

    @property
    def path(self) -> str:
        return f"tinker://{self.model_id}/{KIND_DIRS[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND_DIRS[self.kind]}/{self.name}"


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    base_model: str
    spec: LoraSpec
    user_metadata: dict[str, str] | None = None
    last_request: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # by checkpoint_id
    snapshots: int = 0  # ephemeral sampler snapshots taken
    released: bool = False  # its session finished: adapter and optimizer freed

    def touch(self) -> None:
        self.last_request = datetime.now(timezone.utc)


@dataclass
class Sampler:
    """A sampling session: the base model or an adapter loaded in the engine."""

    sampler_id: str
    base_model: str
    adapter: str | None  # the engine's adapter name; None: the base model
    model_path: str | None = None


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<model>/<weights|sampler_weights>/<name>`` as (model id, kind, name)."""
    if not path.startswith("tinker://"):
        raise ApiError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    kinds = {v: k for k, v in KIND_DIRS.items()}
    if len(parts) != 3 or parts[1] not in kinds or not parts[2]:
        raise ApiError(f"{path!r} is not tinker://<model id>/<weights|sampler_weights>/<name>")
    return parts[0], kinds[parts[1]], parts[2]


def check_name(name: str) -> str:
    """A checkpoint name usable in a path."""
    if not name or "/" in name or name in (".", "..") or len(name) > 200:
        raise ApiError(f"checkpoint name {name!r}: use 1-200 characters without '/'")
    return name


class Registry:
    """Sessions, models, samplers and checkpoints by id."""

    def __init__(self, checkpoint_root: Path) -> None:
        self.root = checkpoint_root
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}

    def new_session(self) -> Session:
        session = Session(uuid.uuid4().hex[:12])
        self.sessions[session.session_id] = session
        return session

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise not_found("session", session_id)
        if session.finished is not None:
            raise ApiError(f"session {session_id!r} has finished ({session.finished})", 410)
        return session

    def model(self, model_id: str, *, live: bool = True) -> TrainingModel:
        """A training model; ``live``: one that can still train (its session has not finished;
        finished ones are kept for their run and checkpoint records)."""
        model = self.models.get(model_id)
        if model is None:
            raise not_found("model_id", model_id)
        if live and model.released:
            raise ApiError(f"model {model_id!r} was released when its session finished; make a "
                           "new training client (e.g. from one of its checkpoints)", 410)
        model.touch()
        return model

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise not_found("sampling_session_id", sampler_id)
        return sampler

    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.root / model_id / KIND_DIRS[kind] / name

    def checkpoint(self, path: str) -> Checkpoint:
        """The checkpoint behind a tinker:// path (saved by this server, also in an earlier
        run with the same checkpoint root)."""
        model_id, kind, name = parse_tinker_path(path)
        model = self.models.get(model_id)
        key = f"{KIND_DIRS[kind]}/{name}"
        if model is not None and key in model.checkpoints:
            return model.checkpoints[key]
        directory = self.checkpoint_dir(model_id, kind, name)
        if not (directory / "adapter_config.json").is_file():
            raise not_found("checkpoint", path)
        return Checkpoint(model_id, kind, name, directory)


__all__ = ["Checkpoint", "Registry", "Sampler", "Session", "TrainingModel", "check_name",
           "parse_tinker_path"]
