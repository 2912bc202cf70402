"""The output head's two terms in row chunks by torch alone, for a TRL without ``trl.kernels`` (before 1.x).

Same call signatures and results as TRL's ``ChunkedLogProbFunction`` and ``ChunkedDivergenceFunction`` (reverse
KL, ``beta = 1``), so ``trainers.losses`` calls whichever ``trainers.trl_compat`` found. The ``(n, V)`` logits are
never held whole: each chunk of rows is computed in the forward and again in the backward (150k-row vocabularies
times ~1M completion tokens would be ~600 GB at once). The logit transform is TRL's: ``z = scale * (h W^T + b)``,
then ``softcap * tanh(z / softcap)`` where a softcap is set, then ``/ temperature``. Math in float32.
"""

from __future__ import annotations

import torch


def _logits(h, w, b, scale, softcap, temperature):
    """``(z, dz/dy)``: the transformed logits of one chunk and their derivative by the raw ones (None = constant)."""
    y = h.float() @ w.float().t()
    if b is not None:
        y = y + b.float()
    y = y * scale
    if softcap is None:
        return y / temperature, None
    t = torch.tanh(y / softcap)
    return softcap * t / temperature, (1 - t * t)


def _chunks(n: int, size: int):
    size = max(int(size), 1)
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _head_grads(dz, dz_dy, h, w, b, scale, temperature, grads):
    """Accumulate the chunk's gradients of ``h``, ``w``, ``b`` from ``dz`` (gradient by the transformed logits)."""
    dy = dz * (scale / temperature)
    if dz_dy is not None:
        dy = dy * dz_dy
    gh = dy @ w.float()
    gw = dy.t() @ h.float()
    gb = dy.sum(0) if b is not None else None
    return gh, gw, gb


class ChunkedLogProbFunction(torch.autograd.Function):
    """``apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)`` ->
    ``(logp (n,), entropy (n,) or None)``, float32; gradients to ``hidden``, ``weight`` and ``bias``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature=1.0, chunk_size=4096, softcap=None, logit_scale=1.0,
                outputs=()):
        n = hidden.size(0)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if "entropy" in outputs else None
        with torch.no_grad():
            for s, e in _chunks(n, chunk_size):
                z, _ = _logits(hidden[s:e], weight, bias, logit_scale, softcap, temperature)
                lz = torch.logsumexp(z, dim=-1)
                lse[s:e] = lz
                logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lz
                if ent is not None:
                    p = torch.exp(z - lz[:, None])
                    ent[s:e] = lz - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent if ent is not None else lse)
        ctx.cfg = (temperature, chunk_size, softcap, logit_scale, ent is not None)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, chunk_size, softcap, scale, has_ent = ctx.cfg
        gh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None else None
        for s, e in _chunks(hidden.size(0), chunk_size):
            z, dz_dy = _logits(hidden[s:e], weight, bias, scale, softcap, temperature)
            logp_all = z - lse[s:e, None]
            p = torch.exp(logp_all)
            dz = torch.zeros_like(z)
            if g_logp is not None:  # d logp_target / dz = onehot - p
                g = g_logp[s:e].float()
                dz -= p * g[:, None]
                dz.scatter_add_(1, targets[s:e, None], g[:, None])
            if has_ent and g_ent is not None:  # dH/dz = -p (log p + H)
                dz -= g_ent[s:e].float()[:, None] * p * (logp_all + ent[s:e, None])
            a, b_, c = _head_grads(dz, dz_dy, hidden[s:e], weight, bias, scale, temperature, None)
            gh[s:e] = a
            gw += b_
            if gb is not None:
                gb += c
        return (gh.to(hidden.dtype), gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)


class ChunkedDivergenceFunction(torch.autograd.Function):
    """``apply(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, beta, temperature, s_scale, s_softcap,
    t_scale, t_softcap)`` -> ``(KL(student || teacher) (n,), student entropy (n,))``; ``beta`` must be 1 (the
    reverse KL, the only divergence ``trainers.losses`` asks for). Gradients to the student's tensors only."""

    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, tb, beta=1.0, temperature=1.0, s_scale=1.0, s_cap=None, t_scale=1.0,
                t_cap=None, chunk_size=4096):
        if beta != 1.0:
            raise ValueError(f"opd's chunked divergence computes the reverse KL only (beta = 1), got beta={beta}")
        n = sh.size(0)
        kl = torch.empty(n, dtype=torch.float32, device=sh.device)
        ent = torch.empty_like(kl)
        with torch.no_grad():
            for s, e in _chunks(n, chunk_size):
                zs, _ = _logits(sh[s:e], sw, sb, s_scale, s_cap, temperature)
                zt, _ = _logits(th[s:e], tw, tb, t_scale, t_cap, temperature)
                ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
                p = ls.exp()
                kl[s:e] = (p * (ls - lt)).sum(-1)
                ent[s:e] = -(p * ls).sum(-1)
        ctx.save_for_backward(sh, sw, sb, th, tw, tb, kl, ent)
        ctx.cfg = (temperature, s_scale, s_cap, t_scale, t_cap, chunk_size)
        return kl, ent

    @staticmethod
    def backward(ctx, g_kl, g_ent):
        sh, sw, sb, th, tw, tb, kl, ent = ctx.saved_tensors
        temperature, s_scale, s_cap, t_scale, t_cap, chunk_size = ctx.cfg
        gh = torch.zeros(sh.shape, dtype=torch.float32, device=sh.device)
        gw = torch.zeros(sw.shape, dtype=torch.float32, device=sw.device)
        gb = torch.zeros(sb.shape, dtype=torch.float32, device=sb.device) if sb is not None else None
        for s, e in _chunks(sh.size(0), chunk_size):
            zs, dz_dy = _logits(sh[s:e], sw, sb, s_scale, s_cap, temperature)
            zt, _ = _logits(th[s:e], tw, tb, t_scale, t_cap, temperature)
            ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
            p = ls.exp()
            dz = torch.zeros_like(zs)
            if g_kl is not None:  # dKL/dz_s = p (log p - log q - KL)
                dz += g_kl[s:e].float()[:, None] * p * (ls - lt - kl[s:e, None])
            if g_ent is not None:  # dH/dz = -p (log p + H)
                dz -= g_ent[s:e].float()[:, None] * p * (ls + ent[s:e, None])
            a, b_, c = _head_grads(dz, dz_dy, sh[s:e], sw, sb, s_scale, temperature, None)
            gh[s:e] = a
            gw += b_
            if gb is not None:
                gb += c
        return (gh.to(sh.dtype), gw.to(sw.dtype), None if gb is None else gb.to(sb.dtype),
                None, None, None, None, None, None, None, None, None, None)
