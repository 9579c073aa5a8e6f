"""POST /invocations and GET|POST /ping: vLLM's SageMaker-compatible routes.

/invocations answers a body as the first endpoint whose request model validates it, in vLLM's order:
a chat completion (`messages`), then a completion (`prompt`); a body neither validates is a 400 naming
both. /ping is the liveness probe under SageMaker's name (/health's answer).
"""

from __future__ import annotations

from pydantic import ValidationError

from runtime.server import protocol as P
from runtime.server.body import parse, read_body
from runtime.server.errors import APIError

#: vLLM's order: earlier types take priority
INVOCATION_TYPES = (("chat", P.ChatCompletionRequest), ("completion", P.CompletionRequest))


def pick(raw: bytes) -> str:
    """The endpoint a body belongs to, or APIError(400) with vLLM's message. Runs in a worker thread."""
    data = parse(raw)
    for name, cls in INVOCATION_TYPES:
        try:
            cls.model_validate(data)
        except ValidationError:
            continue
        return name
    names = [cls.__name__ for _, cls in INVOCATION_TYPES]
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {names}")


class ServingInvocations:
    def __init__(self, chat, completion):
        self.handlers = {"chat": chat, "completion": completion}

    async def invoke(self, request):
        raw = await read_body(request)
        name = await self.handlers["chat"].in_worker(pick, raw)
        return await self.handlers[name].create(request, raw=raw)
