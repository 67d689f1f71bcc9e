"""A scripted stand-in upstream for benchmarks and protocol-boundary tests (not a model).

It lives with the tests, not in the ``gateway`` package: nothing a gateway serves needs it, and the
benchmarks take their other helpers from here too (``tests.conftest.free_port``).

It speaks SGLang's native API (``/generate`` non-stream and stream, ``/health``, ``/get_model_info``,
``/get_server_info``, ``/get_weight_version``, pause/continue) exactly as ``docs/sglang-protocol.md``
describes, and answers every ``/generate`` with the token ids of a scripted reply, tokenized by the real
tokenizer and followed by the end-of-turn token. It also answers the OpenAI ``/v1/chat/completions`` route
with the same fixed text, streamed one chunk per token when asked (the upstream for peers' proxies in
``bench/gateway.py``).

Why it exists: a random tiny model cannot be made to emit, say, two ``<tool_call>`` blocks; the stand-in
returns exactly those tokens, so the gateway's parsing, stitching and recording are tested end to end
over real HTTP with real token ids. Replies come from ``--reply`` (repeatable), used in turn (the n-th
``/generate`` call gets reply ``n mod len``); ``max_new_tokens`` is honoured (finish ``length``).

    python tests/standin.py --port 31000 --tokenizer ~/.cache/agentrl/models/tiny --reply 'Hello!'

Other processes start it by its file (:data:`COMMAND`), so it runs from any working directory (``tests``
is not an installed package).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

DEFAULT_REPLY = "Hello! How can I help you today?"
COMMAND = [sys.executable, str(Path(__file__).resolve())]  # argv that starts it as a process (add its flags)


def build_app(tokenizer_dir: str, replies: list[str], *, context_length: int = 2048,
              end_token: str = "<|im_end|>", tokenizer: Any = None) -> Starlette:
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = tokenizer
    end_id = tok.convert_tokens_to_ids(end_token)
    scripted = [list(tok.encode(r, add_special_tokens=False)) + [end_id] for r in replies or [DEFAULT_REPLY]]
    turn = itertools.count()
    state: dict[str, Any] = {"version": 0, "paused": False, "rid": itertools.count()}

    def output(ids: list[int], max_new: int, prompt_len: int) -> dict[str, Any]:
        out = ids[:max_new]
        finish: dict[str, Any] = (
            {"type": "stop", "matched": end_id} if len(out) == len(ids) else {"type": "length", "length": max_new}
        )
        return {
            "text": tok.decode(out[:-1] if finish["type"] == "stop" else out, skip_special_tokens=True),
            "output_ids": out,
            "meta_info": {
                "id": f"standin-{next(state['rid'])}",
                "finish_reason": finish,
                "prompt_tokens": prompt_len,
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": str(state["version"]),
                "output_token_logprobs": [[-0.25, t, None] for t in out],
            },
        }

    async def generate(request: Request) -> Response:
        body = await request.json()
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return JSONResponse({"error": {"message": "input_ids must be a non-empty list"}}, status_code=400)
        if len(ids) >= context_length:
            return JSONResponse({"error": {"message": "prompt longer than the context"}}, status_code=400)
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        reply = scripted[next(turn) % len(scripted)]
        full = output(reply, max_new, len(ids))
        if not body.get("stream"):
            return JSONResponse(full)

        async def events() -> Any:
            out = full["output_ids"]
            for k in range(1, len(out) + 1):
                chunk = output(out[:k], k, len(ids))
                if k < len(out):
                    chunk["meta_info"]["finish_reason"] = None
                else:
                    chunk = full
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    reply_ids = scripted[0][:-1]
    # the reply's text and, for streams, its per-token pieces (decode of k tokens minus decode of k - 1)
    prefixes = [tok.decode(reply_ids[:k], skip_special_tokens=True) for k in range(len(reply_ids) + 1)]
    pieces = [b[len(a):] for a, b in zip(prefixes, prefixes[1:])]

    async def chat(request: Request) -> Response:  # OpenAI-compatible upstream (for peers' proxies)
        body = json.loads(await request.body() or b"{}")
        text = prefixes[-1]
        if body.get("stream"):
            def chunk(delta: dict[str, Any], finish: str | None) -> str:
                return "data: " + json.dumps({
                    "id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 0, "model": "standin",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

            async def chat_events() -> Any:  # one chunk per token, as the native stream
                yield chunk({"role": "assistant", "content": ""}, None)
                for piece in pieces:
                    yield chunk({"content": piece}, None)
                yield chunk({}, "stop")
                yield "data: [DONE]\n\n"

            return StreamingResponse(chat_events(), media_type="text/event-stream")
        return JSONResponse({
            "id": "chatcmpl-standin", "object": "chat.completion", "created": 0, "model": "standin",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": len(scripted[0]), "total_tokens": 10 + len(scripted[0])},
        })

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def model_info(_: Request) -> Response:
        return JSONResponse({"model_path": tokenizer_dir, "tokenizer_path": tokenizer_dir, "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": str(state["version"])})

    async def server_info(_: Request) -> Response:
        return JSONResponse({"model_path": tokenizer_dir, "context_length": context_length,
                             "max_running_requests": 1024, "weight_version": str(state["version"]),
                             "max_req_input_len": context_length, "version": "standin",
                             "internal_states": [{}]})

    async def weight_version(_: Request) -> Response:
        return JSONResponse({"weight_version": str(state["version"])})

    async def pause(_: Request) -> Response:
        state["paused"] = True
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(_: Request) -> Response:
        state["paused"] = False
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def update_from_disk(request: Request) -> Response:
        body = await request.json()  # the weights stay as they are; only the reported version moves
        state["version"] = int(body.get("weight_version") or state["version"] + 1)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    async def flush(_: Request) -> Response:
        return PlainTextResponse("Cache flushed.")

    return Starlette(routes=[
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health), Route("/health_generate", health),
        Route("/get_model_info", model_info), Route("/get_server_info", server_info),
        Route("/get_weight_version", weight_version),
        Route("/pause_generation", pause, methods=["POST"]),
        Route("/continue_generation", resume, methods=["POST"]),
        Route("/flush_cache", flush, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", update_from_disk, methods=["POST"]),
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tests/standin.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. the tiny model's)")
    parser.add_argument("--reply", action="append", default=[], help="scripted reply text (repeatable)")
    parser.add_argument("--context-length", type=int, default=2048)
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(build_app(args.tokenizer, args.reply, context_length=args.context_length), host=args.host,
                port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
