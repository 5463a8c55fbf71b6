"""Chat templates: a model folder's jinja2 `chat_template`, rendered the way Hugging Face's
`apply_chat_template` renders it, and a template of its own for the embedded model.

Where a folder's template comes from (the first found wins, as transformers loads a folder):

    chat_template.jinja        the file recent Hugging Face folders carry
    tokenizer_config.json      its `chat_template`: a string, or a list of named templates
                               (the one named "default" is used)
    config.json's hicache_embedded marker   EMBEDDED_CHAT_TEMPLATE
    none of these              `load_chat_template` raises NoChatTemplate

The environment is transformers' (`_compile_jinja_template`): sandboxed and immutable,
`trim_blocks` and `lstrip_blocks`, `loopcontrols`, a `{% generation %}` tag that renders its
body, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML. A render
sees `messages`, `add_generation_prompt`, `tools` and `documents` (None), and `bos_token` /
`eos_token` as tokenizer_config.json spells them.

BOS: templates write `bos_token` themselves where the model wants one, so the rendered text
is tokenized without the tokenizer's own specials (`add_special_tokens=False`, as
`apply_chat_template(tokenize=True)` does); BOS is then never doubled.

Prefix stability, which multi-turn cache hits rest on: a template is "stable" when
`render(turn 1, add_generation_prompt=True) + answer` is a prefix of the next turn's render.
The embedded template is; most published ones (ChatML, Llama 3) are too, except that Llama 3
`trim`s message content, so an answer with leading or trailing whitespace breaks the prefix
at that answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hicache_server.tokenizer import EMBEDDED_MARKER_KEY, SPECIAL_TOKENS

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_TEMPLATE_NAME = "default"  # the name transformers picks from a list of templates
# The embedded model's format: one role tag per message, each message on its own lines.
# Byte-level, so the tags are plain bytes; no BOS (it could only be written as text, which
# the byte tokenizer would spell out as bytes), exactly as /v1/completions sends a prompt.
EMBEDDED_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class NoChatTemplate(ValueError):
    """The model folder has no chat template, or one that does not compile; the message says
    which and what to do (chat requests answer it as a 400)."""


class ChatTemplateError(ValueError):
    """The template refused these messages (its `raise_exception`) or failed on them (a 400)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: transformers marks the
    assistant's tokens with it (for training masks); serving has no use for the marks."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: jinja's own escapes HTML characters, which no prompt wants."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template and the special-token strings it is rendered with.

    Immutable once built: `render` may be called from any thread. TemplateSyntaxError (a
    TemplateError) when `source` does not compile.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 origin: str = "") -> None:
        self.source = source
        self.origin = origin  # where it came from, for messages
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._template = _environment().from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`; ChatTemplateError when the template refuses them."""
        try:
            return self._template.render(messages=list(messages), tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._tokens)
        except (TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"the model's chat template ({self.origin}) cannot render "
                                    f"these messages: {e}") from None


def load_chat_template(folder: str | Path) -> ChatTemplate:
    """The chat template of a model folder (see the module docstring for the order);
    NoChatTemplate when it has none or its template does not compile."""
    folder = Path(folder)
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    source, origin = _template_source(folder, config)
    if source is None and _read_json(folder / "config.json").get(EMBEDDED_MARKER_KEY):
        source, origin = EMBEDDED_CHAT_TEMPLATE, "the embedded model's"
        bos, eos = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
    if source is None:
        raise NoChatTemplate(
            f"the model has no chat template: {folder} has neither {TEMPLATE_FILE} nor a "
            f"`chat_template` in {TOKENIZER_CONFIG_FILE}; add one there, or format the prompt "
            "yourself and send it to /v1/completions")
    try:
        return ChatTemplate(source, bos_token=bos, eos_token=eos, origin=origin)
    except TemplateError as e:
        raise NoChatTemplate(f"the model's chat template ({origin}) does not compile: "
                             f"{e}") from None


def _template_source(folder: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """(template text, where it came from); (None, "") when the folder has none."""
    file = folder / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), str(file)
    where = f"{folder / TOKENIZER_CONFIG_FILE} `chat_template`"
    value = config.get("chat_template")
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get(DEFAULT_TEMPLATE_NAME)
    return (value, where) if isinstance(value, str) and value else (None, "")


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    text = value.get("content") if isinstance(value, dict) else value
    return text if isinstance(text, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # UnicodeDecodeError too
        raise NoChatTemplate(f"cannot read the chat template's settings: {path}: {e}") from None
    return data if isinstance(data, dict) else {}
