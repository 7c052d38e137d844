"""Random op inputs shared by the GPU check (``benchmarks/gpu_check/``) and the CUDA kernel tests.

Only tests and benchmarks use these; they build tensors on any device from a seeded generator, so a GPU run
and its CPU emulation see the same layouts.
"""

from __future__ import annotations

import torch

__all__ = ["random_seq_idx", "ssd_inputs"]


def random_seq_idx(batch: int, seq_len: int, seed: int, device: str | torch.device = "cpu", max_seqs: int = 6):
    """A random packed layout: ``seq_idx`` ``[B, T]`` int32 with 1..``max_seqs`` sequences per row.

    The cut points are drawn on the CPU generator, so the layout does not depend on ``device``.
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        n_cuts = int(torch.randint(0, max_seqs, (1,), generator=g))
        cuts = (torch.randperm(seq_len - 1, generator=g)[:n_cuts] + 1).tolist()
        row = torch.zeros(seq_len, dtype=torch.int32)  # [T]
        for c in cuts:
            row[c:] += 1
        rows.append(row)
    return torch.stack(rows).to(device)  # [B, T]


def ssd_inputs(
    batch: int,
    seq_len: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    heads: int = 8,
    head_dim: int = 64,
    groups: int = 2,
    state: int = 64,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Keyword arguments of :func:`safepad.ops.ssd_scan` with well-conditioned random values.

    ``x`` ``[B, T, H, P]``, ``dt`` ``[B, T, H]`` (around softplus⁻¹ of a small step), ``A`` ``[H]`` < 0,
    ``B``/``C`` ``[B, T, G, N]``, ``D``/``dt_bias`` ``[H]`` and ``initial_state`` ``[B, H, P, N]``. ``A``, ``D``
    and ``dt_bias`` stay fp32 (as the models keep them); the rest are ``dtype``.
    """
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    H, P, G, N = heads, head_dim, groups, state
    return {
        "x": r(batch, seq_len, H, P),
        "dt": r(batch, seq_len, H, scale=0.5) - 2.0,
        "A": -torch.rand(H, generator=g, device=device) * 4 - 0.5,
        "B": r(batch, seq_len, G, N, scale=0.3),
        "C": r(batch, seq_len, G, N, scale=0.3),
        "D": torch.randn(H, generator=g, device=device),
        "dt_bias": torch.randn(H, generator=g, device=device) * 0.3,
        "initial_state": torch.randn(batch, H, P, N, generator=g, device=device) * 0.1,
    }
