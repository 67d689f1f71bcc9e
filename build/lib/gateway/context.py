"""What the routes and services share: built once in the app's lifespan and injected via ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from gateway.chat.template import ChatTemplate
from gateway.control import ControlPlane
from gateway.engine_client import EngineRouter
from gateway.metrics import Metrics
from gateway.settings import GatewaySettings
from gateway.store import Store


@dataclass
class Services:
    settings: GatewaySettings
    store: Store
    router: EngineRouter
    tokenizer: Any
    template: ChatTemplate
    metrics: Metrics
    model_name: str
    context_length: int
    implicit: Any  # gateway.binding.ImplicitIndex
    app_state: Any  # the app's ``state``: ``admission`` lives there so that it can be replaced
    control: ControlPlane | None = None  # pause state and weight version shared by every replica

    @property
    def admission(self) -> Any:
        """The current admission control (``gateway.admission.Admission``)."""
        return self.app_state.admission


def services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]
