"""What a client calls the engine's fields, so that a check raises its error with the name
the client sent, where the check is (never renamed by string replacement afterwards).

The engine's own names are SGLang's (`SGLANG_NAMES`): sampling fields inside
`sampling_params` (`sampling_params.max_new_tokens`), the rest at the top
(`top_logprobs_num`, `input_ids`). An OpenAI route hands the engine its own names
(`max_tokens`, `logprobs`, `prompt`, ...: `hicache_server.http.openai_fields.openai_names`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FieldNames:
    renamed: dict[str, str] = field(default_factory=dict)  # engine name -> client's name
    sampling_prefix: str = "sampling_params."  # where the sampling fields sit otherwise

    def sampling(self, name: str) -> str:
        """A sampling field's name (`max_new_tokens` -> `sampling_params.max_new_tokens`)."""
        return self.renamed.get(name, f"{self.sampling_prefix}{name}")

    def option(self, name: str) -> str:
        """A top-level field's name (the prompt, the logprob options, the cache salt)."""
        return self.renamed.get(name, name)


SGLANG_NAMES = FieldNames()
