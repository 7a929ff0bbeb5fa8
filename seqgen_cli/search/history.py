"""Token history of the running rows: what transformers calls ``input_ids`` inside its search loops."""

from __future__ import annotations

import torch


class TokenHistory:
    """Preallocated ``[N, max_length]`` token buffer; columns ``[0, length)`` are filled for every row.

    Columns ``[0, prompt_len)`` hold the decoder prompt (left-padded prompt for decoder-only models, the
    decoder start token for encoder-decoder models), exactly as transformers' ``input_ids`` would.
    """

    def __init__(
        self, prompt: torch.Tensor, max_length: int, pad_lengths: torch.Tensor | None = None
    ) -> None:
        n, prompt_len = prompt.shape  # prompt: [N, P] int64
        self.tokens = torch.zeros((n, max_length), dtype=torch.long, device=prompt.device)  # [N, max_length]
        self.tokens[:, :prompt_len] = prompt
        self.length = prompt_len  # host int: same for all rows (transformers' cur_len)
        self.prompt_len = prompt_len
        # [N] int64: leading pad positions per row (decoder-only left padding), or None when there are none.
        self.pad_lengths = pad_lengths

    @property
    def filled(self) -> torch.Tensor:
        """``[N, length]`` view of the filled columns."""
        return self.tokens[:, : self.length]

    @property
    def generated(self) -> torch.Tensor:
        """``[N, length - prompt_len]`` view of the generated tokens."""
        return self.tokens[:, self.prompt_len : self.length]

    def append(self, tokens: torch.Tensor) -> None:
        """Append one token per row (``tokens``: [N] int64)."""
        self.tokens[:, self.length] = tokens
        self.length += 1

    def select(self, rows: torch.Tensor) -> None:
        """Keep/reorder rows: new row ``i`` is old row ``rows[i]`` ([N'] int64)."""
        self.tokens = self.tokens.index_select(0, rows)
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.index_select(0, rows)
