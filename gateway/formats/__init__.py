"""Wire formats over one conversation core.

Chat completions, the OpenAI Responses API (``responses``) and Anthropic's Messages API (``messages``) are
three ways of writing the same conversation. Each format module parses its request into the core's
conversation model (a :class:`gateway.wire.ChatCompletionRequest`: normalised chat messages, function
tools, sampling fields) and renders the core's results (``GenerationService.run_turn``) and stream events
(``GenerationService.stream_turn``, an async iterator of ``TurnEvent``) back into its own shapes. Planning,
stitching, recording, rewards and export never see which format a turn came in (the recorded request
carries ``format`` for people reading the tree), so a conversation may move between formats and still link
turn to turn as long as its history is the same conversation.

The contract each format satisfies is written down in :mod:`gateway.formats.contract` (``WireFormat``),
and one route serves all of them (``gateway.routes.generation.serve``): ``chat.CHAT``,
``responses.RESPONSES``, ``messages.MESSAGES``.
"""
