"""Gated delta rule, forward + backward: safepad's varlen chunked torch core vs transformers' torch path.

Both run on identical unpacked inputs (B=1, H=8, Dk=Dv=128, chunk 64, q/k L2-normalised in the op, as
Qwen3-Next calls it), measured side by side in one run, interleaved, best of several repeats. A packed
row (4 sequences, ``seq_idx``) is timed too, to show the varlen path costs about the same.

    python benchmarks/bench_ops_gdn.py [--quick]

Prints one line per case and the speed ratios (HF time / safepad time; >= 1.0 means safepad is no slower) last.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from safepad.ops.delta_rule import chunk_gated_delta_rule

__all__ = ["main"]


def _inputs(length: int, heads: int = 8, dk: int = 128, dv: int = 128, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads, dk, generator=gen)
    k = torch.randn(1, length, heads, dk, generator=gen)
    v = torch.randn(1, length, heads, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, length, heads, generator=gen))  # log-decay < 0
    beta = torch.rand(1, length, heads, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _fwd_bwd(fn, inputs: list[torch.Tensor]) -> float:
    for x in inputs:
        x.grad = None
    t0 = time.perf_counter()
    out = fn(*inputs)
    out.square().sum().backward()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, L=512 and 2048 only once each")
    args = parser.parse_args(argv)
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    repeats = 2 if args.quick else 5
    lengths = (512, 2048)

    def hf(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True)[0]

    def ours(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, use_qk_l2norm=True, backend="torch")

    lines: list[str] = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, H=8 Dk=Dv=128 B=1"]
    ratios: list[str] = []
    for length in lengths:
        inputs = _inputs(length)
        seq_idx = (torch.arange(length) * 4 // length).to(torch.int32)[None]  # [1, L]: 4 packed sequences

        def ours_packed(q, k, v, g, beta, _seq=seq_idx):
            return chunk_gated_delta_rule(
                q, k, v, g, beta, chunk_size=64, use_qk_l2norm=True, seq_idx=_seq, backend="torch"
            )

        with torch.no_grad():
            diff = (hf(*inputs) - ours(*inputs)).abs().max().item()
        _fwd_bwd(hf, inputs), _fwd_bwd(ours, inputs)  # warm-up
        t_hf, t_ours, t_packed = [], [], []
        for _ in range(repeats):  # interleaved so that both see the same machine state
            t_hf.append(_fwd_bwd(hf, inputs))
            t_ours.append(_fwd_bwd(ours, inputs))
            t_packed.append(_fwd_bwd(ours_packed, inputs))
        best_hf, best_ours, best_packed = min(t_hf), min(t_ours), min(t_packed)
        lines.append(
            f"L={length:5d}  fwd+bwd  HF torch_chunk_gated_delta_rule {best_hf * 1e3:8.1f} ms | "
            f"safepad {best_ours * 1e3:8.1f} ms | safepad packed (4 seqs, seq_idx) {best_packed * 1e3:8.1f} ms | "
            f"max|Δo| {diff:.1e}"
        )
        ratios.append(f"ratio L={length}: {best_hf / best_ours:.2f}x (packed: {best_hf / best_packed:.2f}x)")
    lines.extend(ratios)
    return lines


if __name__ == "__main__":
    for line in main(sys.argv[1:]):
        sys.stdout.write(line + "\n")
