"""A stand-in inference engine that answers SGLang's ``/generate`` with scripted texts (a test fake).

A random tiny model cannot be made to emit tool calls, so the tool-agent test puts this process behind the
REAL gateway: it speaks the wire format of ``docs/sglang-protocol.md`` and returns, for the k-th
``/generate`` call, the token ids of ``script[k]`` (the last one repeats) tokenized by the real tokenizer,
plus ``<|im_end|>``. Every request it received is kept, so a test can decode the prompts and check what
the model was shown (``GET /requests``).

    python -m tests.agents.scripted_engine --port N --model-dir DIR --script '["text 1", "text 2"]'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from tokenizers import Tokenizer

CONTEXT_LENGTH = 2048


def build_app(model_dir: str, script: list[str]) -> FastAPI:
    # the `tokenizers` library directly: the same tokenizer.json as transformers, far quicker to import
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    end_id = tokenizer.token_to_id("<|im_end|>")
    app = FastAPI()
    received: list[dict[str, Any]] = []

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        text = script[min(len(received), len(script) - 1)]
        received.append(body)
        max_new = int(body.get("sampling_params", {}).get("max_new_tokens", 128))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        finish: dict[str, Any]
        if len(ids) + 1 <= max_new:
            ids = ids + [end_id]
            finish = {"type": "stop", "matched": end_id}
        else:
            ids = ids[:max_new]
            finish = {"type": "length", "length": max_new}
        return {
            "text": tokenizer.decode([i for i in ids if i != end_id]),
            "output_ids": ids,
            "meta_info": {
                "id": body.get("rid") or uuid.uuid4().hex,
                "finish_reason": finish,
                "prompt_tokens": len(body.get("input_ids", [])),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "weight_version": "0",
                "e2e_latency": 0.001,
                "output_token_logprobs": [[-0.5, i, None] for i in ids],
            },
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": model_dir, "tokenizer_path": model_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "0"}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"model_path": model_dir, "context_length": CONTEXT_LENGTH, "max_running_requests": 16,
                "weight_version": "0", "max_req_input_len": CONTEXT_LENGTH, "version": "scripted",
                "internal_states": [{}]}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": "0"}

    @app.get("/requests")
    async def requests() -> list[dict[str, Any]]:
        return received

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        out = respond(body)
        if not body.get("stream"):
            return out

        async def events():
            # SGLang streams cumulative chunks by default; send two, then [DONE]
            ids = out["output_ids"]
            half = max(1, len(ids) // 2)
            first = {**out, "output_ids": ids[:half], "text": tokenizer.decode([i for i in ids[:half] if i != end_id]),
                     "meta_info": {**out["meta_info"], "finish_reason": None, "completion_tokens": half,
                                   "output_token_logprobs": out["meta_info"]["output_token_logprobs"][:half]}}
            yield f"data: {json.dumps(first)}\n\n"
            await asyncio.sleep(0)
            yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--script", required=True, help="JSON list of output texts, one per /generate call")
    args = parser.parse_args()
    uvicorn.run(build_app(args.model_dir, json.loads(args.script)), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
