"""A stand-in judge for the reward tests: an OpenAI-compatible ``/v1/chat/completions`` server on
loopback (a real HTTP server in its own process, so a test can kill it).

    python reward_judge_server.py        # prints "PORT <n>" once it listens

Its reply depends on the rubric prompt it receives, so a test sees that the conversation was
filled in: "<answer>42</answer>" in the prompt -> "Score: 9", "<answer>7</answer>" -> "Score: 42"
(out of range), "<answer>x</answer>" -> no score at all, a rubric with "VARY" in it -> the
prompt's length modulo 11, anything else -> "Score: 3". Every
prompt is appended to the file named by argv[1] (when given).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aiohttp import web


def _log(path: Path, prompt: str) -> None:
    with path.open("a") as f:
        f.write(json.dumps(prompt) + "\n")


async def chat(request: web.Request) -> web.Response:
    body = await request.json()
    prompt = "\n".join(m["content"] for m in body["messages"])
    if len(sys.argv) > 1:
        _log(Path(sys.argv[1]), prompt)
    if "<answer>42</answer>" in prompt:
        reply = "The answer is right. Score: 9"
    elif "<answer>7</answer>" in prompt:
        reply = "Score: 42"
    elif "<answer>x</answer>" in prompt:
        reply = "I cannot say."
    elif "VARY" in prompt:  # a score that differs between conversations
        reply = f"Score: {len(prompt) % 11}"
    else:
        reply = "Score: 3"
    return web.json_response({
        "id": "c1", "object": "chat.completion", "created": 0, "model": body.get("model", "j"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": reply}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })


async def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"PORT {port}", flush=True)
    while True:
        await __import__("asyncio").sleep(3600)


if __name__ == "__main__":
    __import__("asyncio").run(main())
