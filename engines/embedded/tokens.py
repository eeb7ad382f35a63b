"""The tokenizer side of an embedded engine: what ends a row, what pads a batch, how ids read.

Owns the served model's tokenizer and what is read from it once: the
end-of-sequence ids (the tokenizer's and the generation config's), the pad id,
stop-string checks and the text of a finished completion (a matched stop
string trimmed, as SGLang does). Never touches the model's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engines.types import SamplingParams


class Tokens:
    """Token ids and text of one engine's tokenizer."""

    def __init__(self, tokenizer: Any, generation_config: Any) -> None:
        self.tokenizer = tokenizer
        ids = {tokenizer.eos_token_id}
        gen_eos = getattr(generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        # The ids that end a request unless ignore_eos.
        self.eos: frozenset[int] = frozenset(i for i in ids if i is not None)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as SGLang tokenizes a ``text`` prompt."""
        return [self.tokenizer.encode(t) for t in texts]

    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else next(iter(self.eos), 0)

    def bos_id(self) -> int:
        """The BOS id, or the pad id where the tokenizer has none."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.pad_id()

    def stop_ids(self, sp: SamplingParams) -> frozenset[int]:
        """The ids that end a row of ``sp``: its own stop_token_ids, else the EOS ids."""
        return self.eos if sp.stop_token_ids is None else frozenset(sp.stop_token_ids)

    def stop_check(self, stops: tuple[str, ...]) -> Callable[[list[int]], str | None]:
        """A Row.stop_check that finds a stop string in the completion's decoded tail.

        Only the last few tokens are decoded each step: an earlier match would
        have ended the row already.
        """
        window = 4 * max(len(s) for s in stops) + 8

        def check(ids: list[int]) -> str | None:
            tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
            return next((s for s in stops if s in tail), None)

        return check

    def text(self, output_ids: list[int], matched: object) -> str:
        """The completion's text; a matched stop string and what follows it are trimmed."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if isinstance(matched, str) and matched in text:  # SGLang trims a stop string
            text = text[: text.index(matched)]
        return text
