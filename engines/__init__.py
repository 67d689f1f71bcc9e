"""The inference engines the gateway and the trainer speak to: one module per engine kind.

This package imports neither the gateway nor the trainer, so that both import it without an upward arrow:

- :mod:`engines.base`: the wire types (``SamplingParams``, ``EngineOutput``, ``EngineInfo``), the
  :class:`~engines.base.Engine` protocol every kind's client implements, error mapping (the caller picks
  the exception classes: :class:`~engines.base.EngineErrors`) and SSE parsing;
- :mod:`engines.transport`: the seam between a client and what carries its bytes (httpx here; the gateway
  adds its lean HTTP/1.1 client), so that each client has one code path;
- :mod:`engines.control`: what the trainer's control calls share (``post``, ``EngineOpsError``, the
  ``EngineOps`` protocol);
- :mod:`engines.sglang`: SGLang's native API, which the embedded engine speaks too: the release dialect
  (0.5.19 / 0.5.23), the gateway's client (``SGLangClient``) and the trainer's calls (``SGLangOps``);
- :mod:`engines.vllm`: vLLM's token-in/token-out and RL APIs: ``VLLMClient`` and ``VLLMOps``;
- :mod:`engines.kinds`: the one place that knows the kinds: the client and the calls of each, and how an
  engine's kind is told from what it answers.

The gateway binds the clients to its errors and transports in ``gateway.engines``; the router is
``gateway.engine_client.EngineRouter``; the trainer picks its calls with ``trainer.engine_ops.engine_ops``.
``docs/engines.md`` says how to add a kind.
"""

ENGINE_KINDS = ("auto", "sglang", "vllm")
