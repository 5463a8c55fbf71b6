"""The HTTP API (aiohttp): SGLang's /generate, OpenAI's /v1/completions and
/v1/chat/completions, admin, health, metrics.

    app.py        create_app, the error middleware, /health, /metrics, attach_metrics,
                  begin_shutdown
    native.py     POST /generate (SGLang's shape: one prompt or a batch, logprobs, n)
    openai.py     POST /v1/completions (logprobs, echo, n, best_of, lists of prompts)
    openai_fields.py    what both OpenAI routes read alike: renamed sampling fields, refused
                  fields, stream_options, the names the engine's errors use
    openai_logprobs.py  OpenAI's `logprobs` object from the engine's SGLang-shaped entries
    openai_shapes.py    completion choices, `usage`, stream chunks
    chat.py       POST /v1/chat/completions: messages through the model's chat template
    discovery.py  /get_model_info, /get_server_info, /tokenize, /detokenize, /v1/models[/{id}];
                  served_model_name, the model id every OpenAI route answers with
    admin.py      /admin/flush, /admin/tiers, SGLang's aliases, L3 attach and detach
    admin_guard.py  who may call them: a bearer key, or loopback with no browser's Origin or
                  Host; JSON bodies only
    auth.py       the inference routes' bearer key (`protected`) and the caller's tenant
                  scope (`scope_of`); the keys: hicache_server.api_keys, tenancy
    generation.py parsed prompts -> engine requests (all validated before any runs)
    prompts.py    one prompt or a batch, per-prompt values
    fields.py     the field policy: unknown fields ignored (one warning per name), unsupported
                  ones a 400 naming them
    streaming.py  a request's updates as routes read them (what is new, per token); SSE
    offload.py    off_loop: a handler's blocking work (templates, tokenization) off the loop
    body.py       the request body as JSON, its fields' shapes checked
    errors.py     the JSON error shape, HttpError, RequestFailed
    state.py      ServerState (STATE): what every handler shares; the body limits

Imports run one way: app -> routes (native, openai, chat; admin is added by the caller) ->
openai_fields, generation, streaming, body -> errors, state. No route imports another
route, nor app.

Threading: handlers run on the event loop and only wait there; the engine's blocking calls,
chat templates, tokenization and any loop over a prompt go to the default executor
(`offload.off_loop`), never onto the loop.
"""

from __future__ import annotations

from hicache_server.http.admin import add_admin_routes
from hicache_server.http.admin_guard import AdminDenied, check_admin_access, is_loopback
from hicache_server.http.app import attach_metrics, begin_shutdown, create_app
from hicache_server.http.errors import HttpError, RequestFailed
from hicache_server.http.state import STATE, Handler, ServerState

__all__ = ["STATE", "AdminDenied", "Handler", "HttpError", "RequestFailed", "ServerState",
           "add_admin_routes", "attach_metrics", "begin_shutdown", "check_admin_access",
           "create_app", "is_loopback"]
