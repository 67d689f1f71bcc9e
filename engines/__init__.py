"""What the gateway and the trainer both know about inference engines, one module per engine kind.

The gateway (``gateway.engine_client``, ``gateway.engines``) and the trainer (``trainer.engine_ops``,
``trainer.weight_sync``) both speak to engines; what they must agree on lives here, below both of them
(this package imports neither, so each imports it without an upward arrow):

- :mod:`engines.base`: the trainer's control-call helper (:func:`~engines.base.post`,
  :class:`~engines.base.EngineOpsError`), the :class:`~engines.base.EngineOps` protocol, :func:`free_port`;
- :mod:`engines.kinds`: the one place that tells an engine's kind from the routes it answers;
- :mod:`engines.sglang`: SGLang's native API (also the embedded engine's): the release dialect
  (:class:`~engines.sglang.SGLangDialect`: info routes, weight-update sessions, per-rank tensor payloads)
  and the trainer's control operations (:class:`~engines.sglang.SGLangOps`);
- :mod:`engines.vllm`: vLLM's RL API: the trainer's control operations (:class:`~engines.vllm.VLLMOps`).

``docs/engines.md`` says how to add a kind.
"""

ENGINE_KINDS = ("auto", "sglang", "vllm")
