"""The contract of a wire format: what one API (chat completions, OpenAI Responses, Anthropic Messages) must
say for the one generic route (``gateway.routes.generation.serve``) to serve it.

A format is its request model, the prefix of its response ids, the name it is recorded under, the shape
of its errors, the conversion of a parsed request into the conversation core's request (with the metadata
the turn's recorded request keeps about the wire format, and the format's names for the core's fields, which
the core's 400s name), and the rendering of the core's result or of its
stream of events. The route does the rest the same way for every format: authenticate, parse, bind the
session, link the turn into its episode, run the core (``GenerationService.run_turn`` / ``stream_turn``)
while watching the client, and send JSON or SSE. The core never renders: it plans, generates and records;
each format renders out of the core's ``ChoiceRun`` results and ``TurnEvent`` stream.

What is shared follows vLLM's serving base (``vllm/entrypoints/openai/engine/serving.py``:
``OpenAIServing``, one subclass per API, each with its ``request_id_prefix``, one ``handle`` pipeline over a
``ServeContext`` of the request, and ``create_error_response``), with one difference kept from this
project: vLLM's serving classes also run the engine and render, here a format is only the translation,
the pipeline is one route function and the core (which plans, stitches and records) never renders. A
fourth format is one new module with a class that satisfies :class:`WireFormat` and a route that calls
``serve`` with it (``tests/gateway/test_wire_format.py`` writes one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from gateway.wire import ChatCompletionRequest, WireModel

if TYPE_CHECKING:
    from gateway.binding import Caller
    from gateway.context import Services
    from gateway.errors import GatewayError
    from gateway.service import ChoiceRun, TurnEvent, TurnPlan

R = TypeVar("R", bound=WireModel)
R_contra = TypeVar("R_contra", bound=WireModel, contravariant=True)


@dataclass
class CoreRequest(Generic[R]):
    """A request as the format hands it to the core, and what it keeps to render the answer."""

    wire: R  # the request as parsed from the wire (what the episode linker reads)
    core: ChatCompletionRequest  # the conversation core's request
    meta: dict[str, Any] | None  # what the turn's recorded request keeps about its wire format
    state: dict[str, Any] = field(default_factory=dict)  # the format's own, for rendering (its conversation...)
    # core field name -> the name this format's client sent it under, for the ``param`` of the core's 400s
    # (``response_format`` is ``text.format`` in Responses, ``output_config.format`` in Messages)
    wire_names: Mapping[str, str] = field(default_factory=dict)


class WireFormat(Protocol[R_contra]):
    """One API served by ``gateway.routes.generation.serve``; see the module docstring."""

    name: str  # recorded as the request's ``format``; the episode linker's ``api``
    request_model: type[WireModel]  # the body's schema (unknown fields are logged, not refused)
    id_prefix: str  # of the response ids (``chatcmpl``, ``resp_``, ``msg_``): each choice's id is prefix + hex

    def error_body(self, exc: GatewayError) -> tuple[int, dict[str, Any]]:
        """The status and body of an error answered on this format's routes (the app's one error path
        calls it)."""
        ...

    async def to_core(self, svc: Services, who: Caller, req: R_contra) -> CoreRequest[Any]:
        """The core's request for ``req`` (400 for what the format cannot say to the core; a format whose
        request names earlier turns reads them here)."""
        ...

    def render(self, turn: CoreRequest[Any], plan: TurnPlan, runs: list[ChoiceRun], svc: Services) -> dict[str, Any]:
        """The answer to a whole turn (``stream: false``) as a JSON body."""
        ...

    def stream(self, turn: CoreRequest[Any], plan: TurnPlan, runs: list[ChoiceRun],
               events: AsyncIterator[TurnEvent], svc: Services) -> AsyncIterator[bytes]:
        """The answer to a streamed turn: its SSE bytes, out of the core's events (the last ones after the
        ``recorded`` event: the turn is committed before the client learns that it ended)."""
        ...
