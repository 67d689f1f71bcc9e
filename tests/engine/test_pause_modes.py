"""The embedded engine's ``retract`` and ``in_place`` pauses behave as SGLang's (0.5.19
``Scheduler.pause_generation``) across a weight swap.

``retract``: the running request leaves the batch, its KV cache dropped, and waits with its output so far;
after ``continue`` it is prefilled again over prompt + output under the new weights and finishes normally.
``in_place``: the batch and its KV cache (computed under the old weights) stay; the swap is applied while
paused and decoding goes on from the old KV with the new weights. Both report each token's version as
SGLang's ``weight_versions`` spans.

The scheduler runs in this process (its own thread) so that the pause lands after exactly ``K`` tokens:
the request's own update callback asks for it, and the scheduler runs controls before its next step.
"""

from __future__ import annotations

import threading
import pytest
import torch

from engine.sampling import SamplingParams
from engine.scheduler import Request, Scheduler, Snapshot
from engine.service import version_spans
from tests.engine.conftest import reference_logprobs

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198, 1, 4093]
K, N = 5, 14  # pause after K tokens of N


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture
def setup(tiny_model_dir):
    from transformers import AutoTokenizer

    served, old, new = load(tiny_model_dir), load(tiny_model_dir), load(tiny_model_dir)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    scheduler = Scheduler(served, AutoTokenizer.from_pretrained(tiny_model_dir), max_running_requests=4,
                          context_length=2048)
    scheduler.start()
    yield scheduler, old, new
    scheduler.stop()


class Run:
    """One streamed greedy request that asks the scheduler to pause in ``mode`` once it has K tokens."""

    def __init__(self, scheduler: Scheduler, mode: str) -> None:
        self.done = threading.Event()
        self.paused = None
        self.last: Snapshot | None = None

        def on_update(snap: Snapshot) -> None:
            self.last = snap
            if len(snap.output_ids) == K and self.paused is None:
                self.paused = scheduler.control("pause", mode=mode)
            if snap.finish_reason is not None:
                self.done.set()

        params = SamplingParams.parse({"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True},
                                      vocab_size=49152)
        self.req = Request(rid="r", input_ids=list(PROMPT), params=params, on_update=on_update, stream=True,
                           return_logprob=True)
        scheduler.submit(self.req)

    def wait_paused(self) -> None:
        for _ in range(600):
            if self.paused is not None:
                self.paused.result(timeout=60)
                return
            threading.Event().wait(0.1)
        raise AssertionError("the request never reached K tokens")


def greedy_ids(model, prefix: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             attention_mask=torch.ones(1, len(prefix), dtype=torch.long))
    return out[0, len(prefix):].tolist()


def swap(scheduler: Scheduler, new, version: int) -> None:
    scheduler.swap_weights({k: v.clone() for k, v in new.state_dict().items()}, version=version,
                           abort_running=False).result(timeout=60)


def test_retract_keeps_the_request_and_reprefills_it_under_the_new_weights(setup) -> None:
    scheduler, old, new = setup
    run = Run(scheduler, "retract")
    run.wait_paused()
    assert scheduler.counts() == {"num_running_reqs": 0, "num_waiting_reqs": 1}  # back in the queue, no KV
    assert run.req.finish_reason is None and len(run.req.output_ids) == K
    swap(scheduler, new, version=1)  # applied at once: nothing runs
    scheduler.control("continue").result(timeout=60)
    assert run.done.wait(120)
    snap = run.last
    assert snap is not None and snap.finish_reason == {"type": "length", "length": N}  # finished, not aborted
    assert snap.retractions == 1 and snap.token_versions == [0] * K + [1] * (N - K)
    ids = snap.output_ids
    assert ids[:K] == greedy_ids(old, PROMPT, K)
    assert ids[K:] == greedy_ids(new, PROMPT + ids[:K], N - K)
    # tokens after the pause are the new model's over a full recompute of prompt + output (re-prefill)
    assert snap.logprobs[:K] == pytest.approx(reference_logprobs(old, PROMPT, ids[:K]), abs=1e-4)
    assert snap.logprobs[K:] == pytest.approx(reference_logprobs(new, PROMPT + ids[:K], ids[K:]), abs=1e-4)
    assert version_spans(snap.token_versions, snap.weight_version) == [
        {"version": "0", "start": 0, "end": K}, {"version": "1", "start": K, "end": N}]
    assert snap.weight_version == 1  # like SGLang: the version of the last span


def kept_kv_logprobs(old, new, prompt: list[int], ids: list[int], k: int) -> list[float]:
    """log p(ids[j]) for j >= k when the KV of prompt + ids[:k-1] was computed by ``old`` and every later
    position by ``new`` (the engine's cache holds all but the last sampled token, fed at the next step)."""
    import copy

    from transformers import DynamicCache

    from engine.batch import _cache_kwarg

    model = copy.deepcopy(old)
    kv = {_cache_kwarg(model): DynamicCache()}
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt + ids[: k - 1]]), use_cache=True, **kv)
        model.load_state_dict(new.state_dict())
        out = []
        for j in range(k - 1, len(ids) - 1):
            logits = model(input_ids=torch.tensor([[ids[j]]]), use_cache=True, **kv).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), -1)[ids[j + 1]].item())
    return out


def test_in_place_keeps_the_kv_cache_and_goes_on_under_the_new_weights(setup) -> None:
    scheduler, old, new = setup
    run = Run(scheduler, "in_place")
    run.wait_paused()
    assert scheduler.counts() == {"num_running_reqs": 1, "num_waiting_reqs": 0}  # still in the batch
    swap(scheduler, new, version=1)  # applied while paused: neither waits for it nor aborts it
    assert run.req.finish_reason is None and len(run.req.output_ids) == K
    scheduler.control("continue").result(timeout=60)
    assert run.done.wait(120)
    snap = run.last
    assert snap is not None and snap.finish_reason == {"type": "length", "length": N}
    assert snap.retractions == 0 and snap.token_versions == [0] * K + [1] * (N - K)
    ids = snap.output_ids
    assert snap.logprobs[:K] == pytest.approx(reference_logprobs(old, PROMPT, ids[:K]), abs=1e-4)
    assert snap.logprobs[K:] == pytest.approx(kept_kv_logprobs(old, new, PROMPT, ids, K), abs=1e-4)
    # and that is not what a recompute under the new weights gives: the old KV was kept
    recomputed = reference_logprobs(new, PROMPT + ids[:K], ids[K:])
    assert max(abs(a - b) for a, b in zip(snap.logprobs[K:], recomputed)) > 1e-3


def test_a_retracted_request_aborted_while_paused_returns_its_output(setup) -> None:
    """SGLang answers a waiting request that is aborted (``/abort_request``, or a later ``abort`` pause) with
    its output so far and ``finish_reason.type == "abort"``."""
    scheduler, old, _ = setup
    run = Run(scheduler, "retract")
    run.wait_paused()
    scheduler.control("pause", mode="abort").result(timeout=60)
    assert run.done.wait(60)
    snap = run.last
    assert snap is not None and snap.finish_reason is not None and snap.finish_reason["type"] == "abort"
    assert snap.output_ids == greedy_ids(old, PROMPT, K) and snap.token_versions == [0] * K
    assert scheduler.counts() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
    with pytest.raises(ValueError, match="pause mode"):
        scheduler.control("pause", mode="sideways").result(timeout=60)
