"""What the routes and services share: built once in the app's lifespan and injected via ``app.state``.

Every part is typed: the lifecycle's objects (the in-flight registry, the admission hook, the export
loop) are built next to the store in ``gateway.app``'s lifespan and handed in here, so a service reads
``svc.inflight`` instead of probing the app's state for something a route module may have put there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from gateway.admission import Admission
from gateway.binding import ImplicitIndex
from gateway.chat.template import ChatTemplate
from gateway.control import ControlPlane
from gateway.engine_client import EngineRouter
from gateway.lifecycle import InFlight, TrajectoryService
from gateway.metrics import Metrics
from gateway.settings import GatewaySettings
from gateway.store import Store
from gateway.trainer_log import TrainerLog

if TYPE_CHECKING:
    from gateway.episodes.linker import EpisodeLinker


@dataclass
class Services:
    settings: GatewaySettings
    store: Store
    router: EngineRouter
    tokenizer: Any  # a Hugging Face tokenizer (its classes share no base worth naming)
    template: ChatTemplate
    metrics: Metrics
    model_name: str
    context_length: int
    implicit: ImplicitIndex  # implicit mode's episode index
    admission: Admission  # charges new sessions (the staleness budget unless create_app was given another)
    inflight: InFlight  # the turns in flight, which the lifecycle never cuts off
    trajectories: TrajectoryService  # the export loop and what the trajectory routes call
    trainer_log: TrainerLog  # the trainer's step reports (POST /admin/trainer), for the viewer's trainer page
    episodes: EpisodeLinker  # places Messages / Responses / chat requests in their agent episodes
    started_at: float  # when the app started serving (the models' ``created``)
    control: ControlPlane | None = None  # pause state and weight version shared by every replica


def services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]
