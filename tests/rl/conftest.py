"""Shared helpers of the RL tests: GRPO-like [pads | prompt | completion | pads] batches and the per-sequence
reference (each sequence alone through the stock model, no padding, no cache)."""

from __future__ import annotations

import torch


def grpo_batch(spans: list[tuple[int, int]], prompt_width: int, width: int, seed: int = 0):
    """``(input_ids, attention_mask, completion_mask)`` ``[B, width]``: row ``b`` holds ``spans[b] = (p, c)``,
    a prompt of ``p`` tokens left-padded to ``prompt_width`` and a completion of ``c`` tokens right-padded."""
    g = torch.Generator().manual_seed(seed)
    B = len(spans)
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    completion = torch.zeros(B, width, dtype=torch.long)
    for b, (p, c) in enumerate(spans):
        ids[b, prompt_width - p : prompt_width + c] = torch.randint(3, 250, (p + c,), generator=g)
        mask[b, prompt_width - p : prompt_width + c] = 1
        completion[b, prompt_width : prompt_width + c] = 1
    return ids, mask, completion


def alone_logprobs(stock, input_ids, attention_mask, scored, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]``: log softmax(logits / temperature) of each token given its own sequence's earlier tokens, each
    sequence run alone through ``stock``; 0 where ``scored`` is 0 and at each sequence's first token."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    rows = []
    for b in range(input_ids.shape[0]):
        idx = attention_mask[b].nonzero().flatten()
        if idx.numel() < 2:
            rows.append(out[b])
            continue
        seq = input_ids[b, idx]
        logits = stock(seq[None], use_cache=False).logits[0].float() / temperature  # [n, V]
        lp = logits.log_softmax(-1)[:-1].gather(-1, seq[1:, None]).squeeze(-1)  # [n - 1]
        row = torch.zeros(input_ids.shape[1]).index_put((idx[1:],), lp * scored[b, idx[1:]].float())
        rows.append(row)
    return torch.stack(rows)
