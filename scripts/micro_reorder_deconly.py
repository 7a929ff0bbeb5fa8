"""Micro-benchmark: how to keep per-beam generated K/V under beam reordering (one layer, one step).

A) back-pointers + R-fold scores (what ``seqgen_cli.models.deconly.attend`` does): no K/V moves;
B) copy-reorder: ``index_select`` of the used part of per-row caches (K^T [N, H, d, T], V [N, H, T, d]) at
   every reorder, then per-row attention.
Both include the prompt part (shared K^T [B, H, d, P] / V [B, H, P, d], one softmax) and store K transposed.

    python scripts/micro_reorder_deconly.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from seqgen_cli.models.deconly import KVState, attend, begin_step  # noqa: E402


def copy_reorder_step(q, k, v, pk, pv, gk, gv, bias, rows, t: int, scale: float) -> torch.Tensor:
    """B): q, k, v [N, H, d]; gk [N, H, d, T], gv [N, H, T, d] (reordered by copy); pk [B, H, d, P]."""
    N, H, d = q.shape
    B, R = pk.shape[0], N // pk.shape[0]
    gk[:, :, :, :t] = gk[:, :, :, :t].index_select(0, rows)
    gv[:, :, :t] = gv[:, :, :t].index_select(0, rows)
    gk[:, :, :, t], gv[:, :, t] = k, v
    qb = q.view(B, R, H, d).transpose(1, 2)  # [B, H, R, d]
    sp = torch.matmul(qb, pk).mul_(scale) + bias  # [B, H, R, P]
    sg = torch.matmul(q[:, :, None], gk[:, :, :, : t + 1]).mul_(scale)  # [N, H, 1, t+1]
    sg = sg.view(B, R, H, t + 1).transpose(1, 2)  # [B, H, R, t+1]
    p = torch.softmax(torch.cat([sp, sg], -1), -1)
    P = pk.shape[3]
    out = torch.matmul(p[..., :P], pv)  # [B, H, R, d]
    pg = p[..., P:].transpose(1, 2).reshape(N, H, 1, t + 1)
    out = out.transpose(1, 2).reshape(N, H, d) + torch.matmul(pg, gv[:, :, : t + 1])[:, :, 0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--R", type=int, default=4)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--P", type=int, default=400)
    ap.add_argument("--T", type=int, default=60)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    B, R, H, d, P, T = a.B, a.R, a.H, a.d, a.P, a.T
    N = B * R
    pk, pv = torch.randn(B, H, d, P), torch.randn(B, H, P, d)
    bias = torch.zeros(B, 1, 1, P)
    mask = torch.ones(B, P, dtype=torch.long)
    gk_c, gv_c = torch.randn(N, H, d, T), torch.randn(N, H, T, d)
    print(
        f"B={B} R={R} H={H} d={d} P={P} T={T}, threads {a.threads}; ms per layer-step, min / median of {a.reps}"
    )
    for t in (1, T // 2, T - 1):
        st = KVState(
            [pk],
            [pv],
            [torch.randn(B, H, d, T, R)],
            [torch.randn(B, H, T, R, d)],
            bias,
            mask.sum(-1).repeat_interleave(R),
            torch.zeros(N, T, dtype=torch.long),
            R,
            t,
        )
        q, k, v = torch.randn(N, H, d), torch.randn(N, H, d), torch.randn(N, H, d)
        rows = torch.arange(N) // R * R + torch.randint(R, (N,))
        ta, tb = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            st.ptr = st.ptr.index_select(0, rows)
            st.t = t
            attend(q, k, v, 0, st, begin_step(st), 0.125)
            t1 = time.perf_counter()
            copy_reorder_step(q, k, v, pk, pv, gk_c, gv_c, bias, rows, t, 0.125)
            t2 = time.perf_counter()
            ta.append(t1 - t0)
            tb.append(t2 - t1)
        fa, fb = (f"{min(x) * 1e3:6.3f} / {statistics.median(x) * 1e3:6.3f}" for x in (ta, tb))
        print(f"t={t:3d}: A back-pointers {fa} ms   B copy-reorder {fb} ms")


if __name__ == "__main__":
    main()
