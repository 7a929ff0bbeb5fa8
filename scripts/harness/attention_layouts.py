"""Self-attention of one decoder layer at one step, Marian's shape, in the layouts issue 66 asks about.

    python scripts/harness/attention_layouts.py --threads 1 --repeats 15

B inputs x R beams, H heads of d, a span of T positions; ms per call, median (min-max) of ``--repeats`` rounds of 20
calls, the layouts interleaved. float32 and bfloat16 (keys float32, as the caches held them; values bf16):

- ``current``: every beam's keys (``[B, H, d, T*R]``, the back-pointer layout) scored, the bias masking other beams'
  (``attention.attention``);
- ``gathered``: each row's own history gathered by the back-pointers, then scored;
- ``reorder``: a physical reorder's copy of one layer's cache (``index_select`` of the rows), then each row's own;
- ``sdpa``: the same reorder, then ``F.scaled_dot_product_attention``;
- ``sdpa_masked``: SDPA over every beam's keys with the back-pointers' bias as its mask;
- ``float32_values`` (bf16 only): ``current`` with the values held in float32 too (``attention.kv_dtype``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from seqgen_cli.models.attention import attention

B, R, H, D = 32, 4, 8, 64


def layouts(t: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    scale = D**-0.5
    keys = torch.randn(B, H, t, R, D, generator=g)  # float32
    values = torch.randn(B, H, t, R, D, generator=g).to(dtype)
    anc = torch.randint(0, R, (B, t, R), generator=g)  # [B, T, R]: row r's ancestor beam at position t
    anc[:, -1] = torch.arange(R)
    q = torch.randn(B, H, R, D, generator=g).to(dtype)
    seen = torch.zeros(B, R, t, R, dtype=torch.bool).scatter_(3, anc.permute(0, 2, 1)[..., None], True)
    bias = torch.where(seen.view(B, 1, R, t * R), 0.0, float("-inf"))  # [B, 1, R, T*R]
    pos = (torch.arange(t)[None, :, None] * R + anc).permute(0, 2, 1).reshape(B, R * t)  # [B, R*T]
    rows_k = keys.permute(0, 3, 1, 2, 4).reshape(B * R, H, t, D).contiguous()  # [B*R, H, T, d]
    rows_v = values.permute(0, 3, 1, 2, 4).reshape(B * R, H, t, D).contiguous()
    beam = (torch.arange(B)[:, None] * R + torch.randint(0, R, (B, R), generator=g)).view(-1)  # [B*R]
    values32 = values.float()

    def current() -> torch.Tensor:
        return attention(q, keys.view(B, H, t * R, D).transpose(-1, -2), values.view(B, H, t * R, D), bias, scale)

    def gathered() -> torch.Tensor:
        idx = pos[:, None, :, None].expand(B, H, R * t, D)
        k = keys.view(B, H, t * R, D).gather(2, idx).view(B, H, R, t, D)
        v = values.view(B, H, t * R, D).gather(2, idx).view(B, H, R, t, D)
        s = torch.matmul((q * scale).float()[..., None, :], k.transpose(-1, -2))  # [B, H, R, 1, T]
        return torch.matmul(s.softmax(-1).to(v.dtype), v)

    def reorder() -> torch.Tensor:
        k, v = rows_k.index_select(0, beam), rows_v.index_select(0, beam)
        s = torch.matmul((q * scale).float().transpose(1, 2).reshape(B * R, H, 1, D), k.transpose(-1, -2))
        return torch.matmul(s.softmax(-1).to(v.dtype), v)

    def sdpa() -> torch.Tensor:
        k, v = rows_k.index_select(0, beam), rows_v.index_select(0, beam)
        return F.scaled_dot_product_attention(q.transpose(1, 2).reshape(B * R, H, 1, D), k.to(v.dtype), v)

    def sdpa_masked() -> torch.Tensor:
        k, v = keys.view(B, H, t * R, D), values.view(B, H, t * R, D)
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v, attn_mask=bias.to(q.dtype))

    def float32_values() -> torch.Tensor:
        kt = keys.view(B, H, t * R, D).transpose(-1, -2)
        return attention(q, kt, values32.view(B, H, t * R, D), bias, scale)

    fns = dict(current=current, gathered=gathered, reorder=reorder, sdpa=sdpa, sdpa_masked=sdpa_masked)
    if dtype != torch.float32:
        fns["float32_values"] = float32_values
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--spans", type=int, nargs="+", default=[10, 30, 60])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for t in args.spans:
            fns = layouts(t, dtype, g)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(20):
                        fn()
                    times[name].append((time.perf_counter() - start) / 20 * 1e3)
            cells = [f"{n} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for n, v in times.items()]
            print(f"{str(dtype).removeprefix('torch.')} T={t}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
