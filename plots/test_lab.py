"""Tests for plots/lab.py, in the order of the file: the extensions a grid can use (BEMA, the formal
languages, log-length scaling) with theory.md's Appendices D and E, the runner and its runs files,
statistics, tables and figures, the lab's command line, and the checks that README.md and
plots/README.md quote the committed JSON. CPU only, seconds; python -m pytest -q from the
repository root runs it with test_resharpen.py, whose helpers it imports."""

import functools
import glob
import itertools
import json
import math
import multiprocessing
import os
import re
import runpy
import shlex
import signal
import statistics
import sys
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import lab as B   # plots/lab.py; it puts the repository root on sys.path
import resharpen as R
import test_resharpen as T
from test_resharpen import (DT, HERE, SMALL, balance_equations, balanced_margin,
                            length_2_split, load, margin_c, margins_at_every_length, mean,
                            null_space, pair_score_model, permutations, pi, random_weights,
                            randomize, read, relative_to_unseen, skip_rendering, text_model, tiny)

torch.set_num_threads(1)
quick_evaluation = T.quick_evaluation   # the autouse fixture: grids evaluate on 20 inputs here too
expect_exit_2 = functools.partial(T.expect_exit_2, main=B.main)   # the lab's command line


# ---- BEMA (theory.md, section 5) -------------------------------------------------------------
# BEMA is its closed form; without its correction it is the EMA with BEMA's schedule.
def test_bema_equals_its_closed_form():
    model = torch.nn.Linear(2, 2, bias=False).requires_grad_(False)
    theta0, bema = model.weight.detach().clone(), B.BEMA(model)
    thetas = [torch.randn(2, 2, generator=torch.Generator().manual_seed(k)) for k in range(5)]
    ema = theta0
    for t, th in enumerate(thetas, start=1):
        model.weight.copy_(th)
        bema.update(model)
        b, a = (10 + t) ** -0.5, (10 + t) ** -0.2
        ema = (1 - b) * ema + b * th
    assert torch.allclose(bema.averaged()[0], a * (thetas[-1] - theta0) + ema, atol=1e-6)


def test_bema_without_correction_is_the_ema_with_the_same_schedule():
    model = torch.nn.Linear(3, 3).requires_grad_(False)
    bema, plain = B.BEMA(model, correct=False), R.EMA(model, decay=0.5)
    plain.beta = bema.beta          # same schedule, plain update rule
    for k in range(6):
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
        bema.update(model)
        plain.update(model)
    for a, b in zip(bema.averaged(), plain.averaged()):
        assert torch.allclose(a, b)


# ---- formal languages (theory.md, Appendix D) ------------------------------------------------
# The automata against brute force; what one layer, BOS and a norm can see of a stack.
def legal_prefix(seq, task, k, D):
    """Is seq a prefix of some stream of the language?"""
    stack, counts = [], [0] * k
    for tok in seq:
        kind, opens = tok % k, tok < k
        if tok == 2 * k:                                  # END: only with nothing open
            if any(counts):
                return False
        elif task == "dyck" and (len(stack) == D if opens else stack[-1:] != [kind]):
            return False                                  # a full stack, or the wrong close
        elif task == "shuffle" and not opens and counts[kind] == 0:
            return False                                  # a close with no open
        else:
            counts[kind] += 1 if opens else -1
            stack = stack + [kind] if opens else stack[:-1]
    return True


def dyck_probability(seq, k, D):
    """The automaton's probability of the token sequence, rule by rule (theory.md, Appendix D)."""
    stack, prob = [], 1.0
    for tok in seq:
        if not stack:
            rule = {**{o: 1 / (2 * k) for o in range(k)}, 2 * k: 0.5}
        elif len(stack) == D:
            rule = {k + stack[-1]: 1.0}
        else:
            rule = {**{o: 1 / (2 * k) for o in range(k)}, k + stack[-1]: 0.5}
        prob *= rule.get(tok, 0.0)
        if prob == 0:
            return 0.0
        if tok < k:
            stack.append(tok)
        elif tok < 2 * k:
            stack.pop()
    return prob


LANGUAGES = [B.make_task(R.Config(**lang)).cfg for lang in (
    dict(task="dyck", brackets=2, max_depth=2), dict(task="dyck", brackets=1, max_depth=3),
    dict(task="shuffle", brackets=2), dict(task="shuffle", brackets=1))]
each_language = pytest.mark.parametrize("cfg", LANGUAGES, ids=lambda c: f"{c.task}-{c.brackets}")


def random_one_layer(norm, bos=False, n_layer=1):
    return randomize(R.Transformer(R.Config(vocab=5, n_embd=8, n_head=2, norm=norm, mlp=True,
                                            bos=bos, n_layer=n_layer)).double())


def last(model, seq):
    return model(torch.tensor([seq]))[0, -1]


@each_language
def test_language_samplers_emit_legal_streams_and_targets_vanish_exactly_on_illegal_tokens(cfg):
    evaluated = B.Language(cfg).eval_inputs(300)   # fixed streams of 4 x train_len tokens
    assert evaluated.shape == (300, 4 * cfg.train_len)
    sampled = B.Language(cfg).sample(300, 40, torch.Generator().manual_seed(0))
    for seq in sampled.tolist() + evaluated.tolist():
        assert legal_prefix(seq, cfg.task, cfg.brackets, cfg.max_depth)
    seqs = B.Language(cfg).sample(40, 25, torch.Generator().manual_seed(1))
    p = B.Language(cfg).target(seqs, torch.double)   # sums to 1, and is 0 exactly where illegal
    assert torch.allclose(p.sum(-1), torch.ones(40, 25, dtype=torch.double))
    for b, seq in enumerate(seqs.tolist()):
        for t in range(25):
            for a in range(cfg.vocab):
                legal = legal_prefix(seq[: t + 1] + [a], cfg.task, cfg.brackets, cfg.max_depth)
                assert (p[b, t, a] > 0) == legal


@each_language
def test_language_targets_equal_brute_force_over_all_short_streams(cfg):
    # Every stream of length n, weighted by the automaton (Dyck) or, uniform over the legal next
    # tokens (Shuffle), by the product of 1 / their number.
    k, D, v, n = cfg.brackets, cfg.max_depth, cfg.vocab, 6

    def weight(seq):
        if cfg.task == "dyck":
            return dyck_probability(seq, k, D)
        w = 1.0
        for t in range(len(seq)):
            options = [a for a in range(v) if legal_prefix(list(seq[:t]) + [a], "shuffle", k, D)]
            if seq[t] not in options:
                return 0.0
            w /= len(options)
        return w
    streams = {s: w for s in itertools.product(range(v), repeat=n) if (w := weight(s)) > 0}
    assert all(legal_prefix(list(s), cfg.task, k, D) for s in streams)
    prefix_mass = {}
    for s, w in streams.items():
        for t in range(1, n + 1):
            prefix_mass[s[:t]] = prefix_mass.get(s[:t], 0.0) + w
    idx = torch.tensor(list(streams))
    p = B.Language(cfg).target(idx[:, : n - 1], torch.double)
    for b, s in enumerate(streams):
        for t in range(1, n):
            brute = [prefix_mass.get(s[:t] + (a,), 0.0) / prefix_mass[s[:t]] for a in range(v)]
            assert torch.allclose(p[b, t - 1], torch.tensor(brute, dtype=torch.double), atol=1e-12)


@pytest.mark.parametrize("norm", list(R.NORMS))
def test_one_layer_without_bos_sees_only_the_proportions_of_its_prefix(norm):
    # Proposition D.1: '( (' (depth 2: opens 1/4 each, ')' 1/2) and '( ( ( (' (depth 4, full:
    # only ')') get the same logits without BOS or positions. BOS breaks the scaling.
    model = random_one_layer(norm)
    assert torch.allclose(last(model, [0, 0]), last(model, [0, 0, 0, 0]), atol=1e-12)
    with_bos = random_one_layer(norm, bos=True)
    assert not torch.allclose(last(with_bos, [0, 0]), last(with_bos, [0, 0, 0, 0]), atol=1e-3)


@pytest.mark.parametrize("bos", [False, True])
def test_one_layer_cannot_tell_which_bracket_is_on_top_of_the_stack(bos):
    # Proposition D.2: '( [ ( )' ('[' on top) and '[ ( ( )' ('(' on top): one layer, same logits.
    for norm in R.NORMS:
        one = random_one_layer(norm, bos=bos)
        assert torch.allclose(last(one, [0, 1, 0, 2]), last(one, [1, 0, 0, 2]), atol=1e-12)
    two = random_one_layer("post", bos=bos, n_layer=2)
    assert not torch.allclose(last(two, [0, 1, 0, 2]), last(two, [1, 0, 0, 2]), atol=1e-3)


def test_normed_bos_average_turns_on_an_arc_and_one_relu_feature_separates_depth_0():
    # Appendix D, at eps = 0, n = 6: p_h = LN(e_0 + h e_1), of norm sqrt(n). (a) The angle of p_h
    # from p_0 in their plane rises strictly with h and stays below the angle between C e_0 and
    # C e_1, arccos(-1/(n-1)), tending to it; an affine readout equal at depths 1, 2, 3 is equal
    # at 0. (b) One ReLU feature relu(p_h . p_0 - c), c halfway between p_1 . p_0 and n, is
    # positive at depth 0 and 0 at every depth >= 1: K relu(..) is (n - p_1 . p_0) K / 2 higher
    # at 0. (c) post's ln_2 (eps > 0, random gain and bias) turns r * w into a switch: its bias at
    # r = 0 (at eps = 0, 0/0), about b + g (w - mean) / sd for large r.
    n, H, e = 6, 400, torch.eye(6, dtype=DT)
    ln = lambda z: torch.nn.functional.layer_norm(z, (n,), eps=0.0)   # noqa: E731
    pts = torch.stack([ln(e[0] + h * e[1]) for h in range(H)])
    assert torch.allclose(pts.norm(dim=1), torch.full((H,), math.sqrt(n), dtype=DT))
    c0, c1 = e[0] - 1.0 / n, e[1] - 1.0 / n
    b1 = c0 / c0.norm()
    b2 = c1 - (c1 @ b1) * b1
    b2 = b2 / b2.norm()
    angle, end = torch.atan2(pts @ b2, pts @ b1), math.acos(-1 / (n - 1))
    assert torch.allclose(pts - (pts @ b1)[:, None] * b1 - (pts @ b2)[:, None] * b2,
                          torch.zeros_like(pts), atol=1e-12)        # in the plane
    assert abs(angle[0].item()) < 1e-12
    assert (angle[1:] - angle[:-1]).min() > 0 and angle.max() < end
    assert angle[-1].item() == pytest.approx(end, abs=0.01)
    X = torch.cat([pts[:4], torch.ones(4, 1, dtype=DT)], 1)   # affine readouts X @ w ...
    free = null_space(torch.stack([X[1] - X[2], X[2] - X[3]]), tol=1e-12)   # ... equal at 1, 2, 3
    assert ((X[0] - X[1]) @ free).abs().max() < 1e-9                        # ... are equal at 0
    dot = pts @ pts[0]
    feature = (dot - (dot[1] + n) / 2).clamp_min(0)
    assert feature[0] > 0 and feature[1:].abs().max() == 0
    assert (feature[0] - feature[1]).item() == pytest.approx((n - dot[1].item()) / 2, rel=1e-12)
    ln_2 = random_weights(R.Block(R.Config(n_embd=n, mlp=True, norm="post")).ln_2).double()
    w = torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=DT)
    assert torch.equal(ln_2(0 * w), ln_2.bias) and ln(0 * w).isnan().all()
    assert torch.allclose(ln_2(1e6 * w), ln_2.bias + ln_2.weight * ln(w), atol=1e-9)


def test_a_norm_on_a_bos_average_recovers_the_depth_at_any_length():
    # Appendix D: the BOS average shrinks with the length; its LayerNorm (eps 0) is the depth's alone
    def attn_average(opens, closes):   # BOS e_0, each open +e_1, each close -e_1, averaged
        return torch.tensor([1.0, opens - closes, 0, 0], dtype=DT) / (1 + opens + closes)
    ln = lambda h: F.layer_norm(h, (4,), eps=0.0)
    for depth in range(4):
        short, long = attn_average(depth, 0), attn_average(depth + 20, 20)
        assert not torch.allclose(short, long)
        assert torch.allclose(ln(short), ln(long), atol=1e-12)
    assert not torch.allclose(ln(attn_average(1, 0)), ln(attn_average(2, 0)))


# ---- log-length scaling and the other remedies (theory.md, Appendix E) -----------------------
# Scaling, dropout and a BOS sink leave the 1/s law of section 2 (E.1-E.3).
def bos_sink_model(v, b, delta, Delta=0.0, attn_scale="none"):
    """E.3's model in the Transformer with --bos: B = -d, D = -delta I + d, BOS value d (d != 0),
    BOS score b above the others, and an own-key bonus Delta. Features: 0 constant, 1 BOS
    flag, 2 .. v+1 read by U, v+2 .. 2v+1 the token (not read)."""
    n, eye = 2 * v + 2, torch.eye(v, dtype=DT)
    d, E = torch.linspace(-1, 1, v, dtype=DT) ** 2, torch.zeros(v + 1, n, dtype=DT)
    E[:, 0] = E[v, 1] = 1.0                           # constant, BOS flag
    E[torch.arange(v), v + 2 + torch.arange(v)] = 1.0
    W_Q, W_K, W_V = (torch.zeros(n, n, dtype=DT) for _ in range(3))
    W_Q[0, 0] = b * math.sqrt(n)                      # every query (1, 0, ..)
    W_K[1, 0] = 1.0                                   # key 1 on BOS only: score b
    W_Q[v + 2:, v + 2:] = Delta * math.sqrt(n) * eye  # own-key bonus Delta
    W_K[v + 2:, v + 2:] = eye
    W_V[0, 2:v + 2] = d                               # constant feature -> d
    W_V[v + 2:, 2:v + 2] = -delta * eye               # token x -> -delta e_x
    U = torch.zeros(n, v, dtype=DT)
    U[2:v + 2] = eye
    U[0] = -d                                         # B = -d
    return text_model(E, U, W_V, None, W_Q, W_K, bos=True, attn_scale=attn_scale)


def test_log_length_scaling_multiplies_each_querys_scores_by_s_h_log_n():
    # By hand, one head and one query at a time, n = t + 1 positions seen (BOS's among them).
    model = randomize(R.Transformer(tiny(attn_scale="logn", n_head=2, bos=True)))
    attn = model.requires_grad_(False).blocks[0].attn
    attn.log_scale.copy_(torch.tensor([0.7, 1.3]))
    idx = torch.tensor([[3, 0, 6, 2]])
    _, atts = model(idx, return_attn=True)
    x = model.blocks[0].ln_1(model.wte(torch.tensor([7, 3, 0, 6, 2])))   # BOS is token 7
    Wq, Wk, _ = attn.c_attn.weight.split(8, dim=0)
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        for t in range(5):
            scores = torch.stack([(Wq[sl] @ x[t]) @ (Wk[sl] @ x[i]) / 2 for i in range(t + 1)])
            want = torch.softmax(attn.log_scale[h] * math.log(t + 1) * scores, dim=0)
            if t >= 1:   # BOS's own row is cut from the returned weights
                assert torch.allclose(atts[0][0, h, t - 1, : t + 1], want, atol=1e-6)


def test_log_length_scaling_keeps_equal_scores_equal_and_the_margin_m1_over_s():
    # E.1 with --attn-scale logn, learned scale 0.8: (a) on the pair-score model the weights are
    # softmax(0.8 log(s) Delta [x = y]) and the logits Theorem 2's with those weights; (b) equal
    # scores stay equal: the hand-built Pre-Norm model keeps margin m_1 / s = predicted_margin.
    v, Delta, scale = 6, 0.9, 0.8
    probe = pair_score_model(v, Delta, attn_scale="logn")
    probe.blocks[0].attn.log_scale.fill_(scale)
    alpha = length_2_split(probe, v)[0, 1].item()
    assert alpha == pytest.approx(1 / (1 + math.exp(scale * math.log(2) * Delta)), rel=1e-12)
    model = pair_score_model(v, Delta, alpha, attn_scale="logn")
    model.blocks[0].attn.log_scale.fill_(scale)
    perm, eye = permutations(3, v, seed=1)[:, : v - 1], torch.eye(v, dtype=DT)
    logits, atts = model(perm, return_attn=True)
    for b in range(3):
        for s in range(1, v):
            t, y = perm[b, :s].tolist(), perm[b, s - 1].item()
            bonus = math.exp(scale * math.log(s) * Delta)
            want = torch.tensor([1.0] * (s - 1) + [bonus], dtype=DT) / (s - 1 + bonus)
            a = atts[0][b, 0, s - 1, :s]
            assert torch.allclose(a, want, atol=1e-12)
            f = -2 * alpha * eye[y] - sum(ai * (eye[ti] - eye[y]) for ai, ti in zip(a.tolist(), t))
            assert torch.allclose(relative_to_unseen(logits[b, s - 1], t), f, atol=1e-12)
    v, n = 8, 16   # (b)
    scaled = R.Transformer(R.Config(vocab=v, n_embd=n, attn_scale="logn")).double()
    scaled.requires_grad_(False).load_state_dict(R.hand_built(v, "pre").state_dict(), strict=False)
    scaled.blocks[0].attn.log_scale.fill_(3.0)
    scaled.blocks[0].attn.c_attn.weight[:n].zero_()
    scaled.blocks[0].attn.c_attn.weight[0, v:] = 1.0       # W_Q: any token -> q_0 = 1
    scaled.blocks[0].attn.c_attn.weight[n, v:] = 0.7       # W_K: any token -> k_0 = 0.7
    m = margins_at_every_length(scaled.eval(), v)
    for s, ms in enumerate(m, start=1):
        assert ms == pytest.approx(m[0] / s, rel=1e-10)
        assert ms == pytest.approx(B.predicted_margin(v, "pre", s), rel=1e-10)


def test_log_length_scaling_breaks_proportions_and_lemma_a():
    # Proposition D.1 and Lemma A need scores not rescaled by length: the same random weights
    # give '( ( )' and '( ( ( ( ) )' the same last logits without logn, not with it; and with
    # logn the length-2 splits no longer give the length-3 weights by Lemma A.
    g, diffs = torch.Generator().manual_seed(0), []
    for norm in R.NORMS:
        models = {scale: R.Transformer(R.Config(vocab=5, n_embd=8, n_head=2, norm=norm, mlp=True,
                                                attn_scale=scale)).double().eval()
                  .requires_grad_(False) for scale in ("none", "logn")}
        for p in models["none"].parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DT) * (0.5 if p.dim() == 2 else 0.3)
                    + (p.dim() == 1))
        models["logn"].load_state_dict(models["none"].state_dict(), strict=False)
        ends = {k: (last(m, [0, 0, 2]), last(m, [0, 0, 0, 0, 2, 2])) for k, m in models.items()}
        assert torch.allclose(*ends["none"], atol=1e-12)
        diffs.append(f'{(ends["logn"][0] - ends["logn"][1]).abs().max().item():.2g}')
    assert_quoted(["largest difference is {} (`pre`), {} (`pre-final`), {} (`post`), {} "
                   "(`post-residual`)".format(*diffs)], "theory.md")   # theory.md, Proposition D.1
    # Lemma A with logn: head 0's weights at length 3 against the odds read at length 2.
    model, alpha = models["logn"], length_2_split(models["logn"], 5)
    att3 = model(torch.tensor([[1, 3, 0]]), return_attn=True)[1][0][0, 0, 2]
    r = (alpha / (1 - alpha))[0, [1, 3, 0]]
    assert (att3 - r / r.sum()).abs().max() > 0.01


def test_dropout_at_training_time_leaves_the_expected_logits_of_pre_unchanged():
    # Appendix E.2: `pre` without a final norm is linear in both dropout masks, so the mean of its
    # training-mode logits is its evaluation-mode logits (Monte Carlo, float64).
    torch.manual_seed(0)
    v, p, reps = 6, 0.3, 40000
    model = R.Transformer(R.Config(vocab=v, n_embd=8, n_head=2, norm="pre", dropout=p)).double()
    g, idx = torch.Generator().manual_seed(0), torch.tensor([[3, 0, 5, 1]])
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, dtype=DT) * 0.5 + (prm.dim() == 1))
        clean = model.eval()(idx)[0, -1]
        noisy = model.train()(idx.repeat(reps, 1))[:, -1]
    mean, se = noisy.mean(0), noisy.std(0) / math.sqrt(reps)
    assert (noisy.std(0) > 0.05).all()                         # dropout is on
    assert ((mean - clean).abs() < 4.5 * se).all()


@pytest.mark.parametrize("b", [0.0, 1.5])
def test_bos_sink_balance_at_lengths_1_and_2_gives_the_margin_m1_eb1_over_eb_s(b):
    # Appendix E.3: m_2 = m_1 (e^b + 1)/(e^b + 2), D == -delta' I + d, delta' = m_1 (e^b + 1),
    # D_0 == d, B == -d; at length s balanced with margin m_1 (e^b + 1) / (e^b + s).
    v, e = 5, math.exp(b)
    P, eye = torch.eye(v, dtype=DT) - 1.0 / v, torch.eye(v, dtype=DT)
    N = null_space(balance_equations(v, b=b))
    assert N[-1].abs().max() > 1e-3 and (N[-1] - N[-2] * (e + 1) / (e + 2)).abs().max() < 1e-9
    z = N @ torch.randn(N.shape[1], generator=torch.Generator().manual_seed(0), dtype=DT)
    z = z / z[-2]                                                         # m_1 = 1
    Bias, D, D0 = z[: v * v].view(v, v), z[v * v: 2 * v * v].view(v, v), z[2 * v * v: 2 * v * v + v]
    d = (D + (e + 1) * eye) @ P                                           # delta' = e^b + 1
    assert (d - d[0]).abs().max() < 1e-9                                  # common row
    assert ((D0 @ P) - d[0]).abs().max() < 1e-9                           # D_0 == d
    assert ((Bias @ P) + d[0]).abs().max() < 1e-9                         # B == -d
    for s in range(1, v):
        t = list(range(s))
        f = Bias[t[-1]] + e / (e + s) * D0 + D[t].sum(0) / (e + s)
        assert balanced_margin(f, t, tol=1e-9) == pytest.approx((e + 1) / (e + s), rel=1e-9)


def test_bos_sink_solution_with_any_weights_gives_minus_delta_prime_sum_of_a_i_e_t_i():
    # E.3 (bos_sink_model: D = -delta' I + d, D_0 = d, B = -d; scores b on BOS, an own-key bonus
    # Delta): with ANY weights (p on BOS, a_i on the seen tokens) f == -delta' sum_i a_i e_(t_i),
    # balanced iff the a_i are equal (Delta = 0), with margin delta' (1 - p) / s. Its own weights
    # p = e^b / (e^b + s) give m_1 (e^b + 1) / (e^b + s); --attn-scale logn gives others.
    v, b, delta = 6, 1.2, 2.5
    eye, perm, e = torch.eye(v, dtype=DT), permutations(3, v, seed=2)[:, : v - 1], math.exp(b)
    for Delta, scale in ((0.0, "none"), (0.0, "logn"), (0.7, "logn")):
        model = bos_sink_model(v, b, delta, Delta, attn_scale=scale)
        if scale == "logn":
            model.blocks[0].attn.log_scale.fill_(0.8)
        logits, atts = model(perm, return_attn=True)
        for k in range(3):
            for s in range(1, v):
                t = perm[k, :s].tolist()
                w = atts[0][k, 0, s - 1, : s + 1]            # BOS, then the s tokens
                p, a = w[0].item(), w[1:]
                off = abs(p - e / (e + s))
                assert off < 1e-10 if scale == "none" else off > 1e-3
                f = -delta * (a[:, None] * eye[t]).sum(0)
                rel = relative_to_unseen(logits[k, s - 1], t)
                assert torch.allclose(rel, f, atol=1e-12)
                if Delta == 0.0:
                    assert torch.allclose(rel[t], torch.full((s,), -delta * (1 - p) / s,
                                                              dtype=DT), atol=1e-12)
                elif s > 1:
                    assert (rel[t].max() - rel[t].min()).item() > 1e-3   # not balanced


# ---- the runner and the grids ----------------------------------------------------------------
# Every grid runs end to end; runs files are kept whole, checked and resumed; Ctrl-C and the ETA.
def grid_key(run):   # the run's key in its grid's chosen_lr
    return "{norm}, {targets}, {lr_schedule}".format(**run["config"])


def runs_of(runs, regime=None, **config):
    """The runs in regime ("targets, lr_schedule") whose config has config's values, in order."""
    return [r for r in runs if regime in (None, "{targets}, {lr_schedule}".format(**r["config"]))
            and all(r["config"][k] == value for k, value in config.items())]


def test_every_grid_runs_end_to_end(tmp_path, monkeypatch, capsys):
    skip_rendering(monkeypatch)
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 1)   # in this process
    base = R.Config(vocab=6, train_len=3, n_embd=8, steps=3, batch_size=4, device="cpu")
    B.alternatives(base, str(tmp_path), "cmd")
    assert all(f"| {name} | EMA 0.999 |" in read(tmp_path / "alternatives.md")
               for name in B.ALTERNATIVES)
    drawn = B.search_configs(40, 0)
    for pre, pre_final, post in drawn:   # the pre-registered ranges; arms differ only in norm
        v = pre.vocab
        assert 16 <= v <= 64 and math.ceil(v / 4) <= pre.train_len <= (v - 1) // 2
        assert pre.n_embd >= 2 * v - 2 and pre.n_embd % pre.n_head == 0
        assert 3e-4 <= pre.lr <= 1e-2 and 64 <= pre.batch_size <= 256 and pre.dropout == 0
        assert 1000 <= pre.steps <= 4000 and pre.ema == 0 and pre.targets == "sampled"
        assert (pre.norm, pre_final, post) == ("pre", B.replace(pre, norm="pre-final"),
                                               B.replace(pre, norm="post"))
    tuned = B.search_configs(24, 1000, [1e-3, 1e-2])   # pre-final and post, each at both rates
    for runs in tuned:
        c = runs[0]
        assert [(r.norm, r.lr) for r in runs] == [("pre-final", 1e-3), ("pre-final", 1e-2),
                                                  ("post", 1e-3), ("post", 1e-2)]
        assert 192 <= c.batch_size <= 256 and 4000 <= c.steps <= 8000
        assert all(B.replace(r, norm=c.norm, lr=c.lr) == c for r in runs)
    deep = B.search_configs(40, 0, mlp=True)   # section 3's draws, with MLPs, 1-3 blocks, NO_LN2
    for plain, runs in zip(drawn, deep):
        assert runs == [B.replace(c, mlp=True, n_layer=runs[0].n_layer) for c in plain] + [
            B.replace(runs[0], mlp=True, mlp_norm=False)] and 1 <= runs[0].n_layer <= 3
    assert {runs[0].n_layer for runs in deep} == {1, 2, 3}
    small = lambda n, seed, lrs=None, mlp=False: [  # noqa: E731
        [B.replace(c, vocab=8, train_len=3, n_embd=12, steps=3, batch_size=4) for c in g]
        for g in (tuned if lrs else deep if mlp else drawn)[:n]]
    monkeypatch.setattr(B, "search_configs", small)
    B.search(base, str(tmp_path), 3, "cmd")
    assert load(tmp_path / "search.json")["summary"]["pre-final"]["ema"]["all"]["n"] == 3
    B.search(B.replace(base, mlp=True), str(tmp_path / "m"), 3, "cmd")
    summary = load(tmp_path / "m" / "search.json")["summary"]
    assert list(summary) == ["pre-final", "post", B.NO_LN2] and "pre_wins" in summary["post"][
        "ema"]["all"] and "`pre, no MLP norm` in" in read(tmp_path / "m" / "search.md")
    B.search(base, str(tmp_path / "t"), 2, "cmd", lrs=[1e-3, 1e-2])
    record = load(tmp_path / "t" / "search.json")
    assert len(record["runs"]) == 8 and set(record["summary"]) == {"pre-final"}
    monkeypatch.setattr(B, "SUITE_SEEDS", 2)
    monkeypatch.setattr(B, "COMPARE_SEEDS", 2)
    monkeypatch.setattr(B, "REGIMES", (("sampled", "constant"),))   # all 4: committed-table test
    base = R.Config(vocab=6, train_len=2, n_embd=8, steps=2, batch_size=2, device="cpu")
    B.compare(base, str(tmp_path), "cmd")
    assert {"compare.md", "compare.json", "compare_norms.png", "compare_regimes.png"} <= set(
        os.listdir(tmp_path))
    # Tuned rates (every rate on the first seed, the best one on the others), two layers:
    B.compare(B.replace(base, n_layer=2, mlp=True), str(tmp_path / "t"), "cmd",
              norms=("pre", "post"), regimes=(("exact", "cosine"),), lrs=[1e-3, 1e-2])
    record = load(tmp_path / "t" / "compare.json")
    runs = [(r["config"]["norm"], r["config"]["lr"], r["config"]["seed"]) for r in record["runs"]]
    chosen = record["chosen_lr"]
    assert len(runs) == 2 * 2 + 2 * 1 and set(chosen) == {"pre, exact, cosine",
                                                          "post, exact, cosine"}
    for norm in ("pre", "post"):
        first = {r["config"]["lr"]: R.summarize(r["ema"], 2)["tvd_train"]
                 for r in runs_of(record["runs"], norm=norm, seed=0)}
        best = chosen[f"{norm}, exact, cosine"]
        assert best == min(first, key=first.get)
        assert {s for n, lr, s in runs if n == norm and lr == best} == {0, 1}
    text = read(tmp_path / "t" / "compare.md")
    assert "per layer" in text and "| exact, cosine | `post` | 2 |" in text
    assert text.startswith("Written by `cmd` (v=6, train lengths 1..2, width 8, 2 layer(s), MLP")
    # Without the MLP norm (P11's ablation), beside the grid above as its depth2:
    os.renames(tmp_path / "t" / "compare.json", tmp_path / "a" / "depth2" / "compare.json")
    B.compare(B.replace(base, n_layer=2, mlp=True, mlp_norm=False),
              str(tmp_path / "a/mlp_norm/layers2"), "cmd", ("pre",), (("exact", "cosine"),),
              [1e-3, 1e-2])
    B.mlp_norm_table(str(tmp_path / "a"))
    record = load(tmp_path / "a/mlp_norm/layers2/compare.json")
    bare = [r["ema"] for r in runs_of(record["runs"], lr=record["chosen_lr"]["pre, exact, cosine"])]
    rho = sum(m["logit_gap"][3] * 4 for m in bare) / sum(m["logit_gap"][1] * 2 for m in bare)
    table = read(tmp_path / "a/mlp_norm/mlp_norm.md")
    assert table.splitlines()[-1].startswith("| 2 | exact, cosine | no |")
    assert table.endswith(f" | {rho:.2f} |\n")
    B.suite(base, str(tmp_path), "cmd", steps=3, batch_size=4, n_embd=8, train_len=4)
    text = read(tmp_path / "suite.md")
    assert "Dyck-(2, 4)" in text and "| Shuffle-2 | `pre-final` - `post` |" in text
    assert text.isascii() and capsys.readouterr().out.isascii()


def test_the_pool_workers_start_with_ctrl_c_blocked_and_one_while_they_start_stops_the_grid(
        monkeypatch, capsys):
    # Ctrl-C goes to the parent alone, which stops the workers: none prints a traceback. A Ctrl-C
    # while they start is kept until they have, then stops the grid before any run.
    seen = []

    class Pool:
        def __init__(self, workers):
            seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)   # pending: blocked

        def imap_unordered(self, job, runs):
            seen.append("trained")

        def terminate(self):
            seen.append("terminated")
    monkeypatch.setattr(multiprocessing, "get_context", lambda kind: type("C", (), {
        "Pool": staticmethod(Pool)}))
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 2)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)   # a background job: ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            B.run_grid([R.Config(), B.replace(R.Config(), seed=1)], "cpu")
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [True, "terminated"] and signal.SIGINT not in signal.pthread_sigmask(
        signal.SIG_BLOCK, [])


def test_a_grid_counts_the_runs_it_trains_at_once(monkeypatch, capsys, tmp_path):
    # About 4.2 GiB a run: one fits under 8 GiB, two at once do not.
    argv = ["--compare", "--regimes", "sampled/constant", "--vocab", "256", "--train-len", "100",
            "--n-embd", "8", "--batch-size", "1500", "--out", str(tmp_path)]
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 2)
    expect_exit_2(argv, "2 run(s) at once", capsys)
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 1)
    monkeypatch.setattr(B, "compare", lambda *a, **k: None)
    B.main(argv)
    # A real pool of two spawned workers: each imports plots/lab.py and resharpen.py by itself.
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 2)
    runs = B.compare_grid(R.Config(vocab=5, train_len=2, n_embd=8, steps=2, batch_size=4,
                                   device="cpu"), ("pre",), (("exact", "cosine"),), seeds=[2, 0, 1])
    done, _, workers = B.run_grid(runs, "cpu")
    assert workers == 2 and [c for c, _, _ in done] == runs and "[ 3/3]" in capsys.readouterr().out


def test_a_runs_file_the_grid_would_not_keep_whole_stops_it_before_training(tmp_path, capsys):
    # Without --resume, with other flags, or with a line that is not a run of this grid: one
    # line, exit 2, nothing trained and the file as it was.
    argv = ["--compare", "--norms", "pre", "--regimes", "exact/cosine", "--out", str(tmp_path)]
    cfg = B.compare_grid(R.Config(steps=2, batch_size=4, n_embd=8, device="cpu"), ("pre",),
                         (("exact", "cosine"),))[0]
    m = R.evaluate(R.Transformer(cfg), n_perm=2)   # every metric, at s = 1 .. 31
    run = {"config": R.asdict(cfg), "device": "cpu", "seconds": 1.0, "raw": m, "ema": m, "bema": m}
    without = lambda d, key: {k: v for k, v in d.items() if k != key}  # noqa: E731
    path, resume = tmp_path / "compare.runs.jsonl", ["--resume"]
    second_lines = [(x, "line 2: not a run") for x in (  # after a run, with --resume
        None, {**run, "config": {**run["config"], "old_key": 1}}, {"config": run["config"]},
        without(run, "bema"), {**run, "device": "cuda"})] + [
        ("", "(it is blank)"), ("\ufeff" + json.dumps(run), "byte-order mark"),
        ({**run, "seconds": "3"}, "wrong kind"), (without(run, "raw"), "(no key 'raw')")] + [
        (x, "(a metric that is not 31 numbers in its range") for x in (
            {**run, "ema": {**m, "tvd": m["tvd"][1:]}}, {**run, "raw": {**m, "kl": None}},
            {**run, "bema": {**m, "tvd": ["0.1"] * 31}}, {**run, "ema": {**m, "gap": m["tvd"]}},
            {**run, "raw": without(m, "logit_gap")}, {**run, "ema": {**m, "kl": [math.nan] * 31}},
            {**run, "ema": {**m, "logit_gap": [1e300] * 31}}, {**run, "bema": {**m, "kl": [1e5] * 31}},
            {**run, "raw": {**m, "tvd": [5] * 31}})] + [
        ({**run, "seconds": x}, "not a number of seconds") for x in (math.nan, math.inf, -1.0)]
    for lines, flags, said in [([run], [], "holds 1 finished run(s)"),
                               ([run], [*resume, "--steps", "3"], "(its steps 2)"),
                               ([run], [*resume, "--device", "auto"], "(its device 'cpu')"),
                               (["{cut", run], resume, "line 1: not a run"),
                               ([run, "{cut", run], resume, "line 2: not a run"),
                               ([run], [*resume, "utf-16"], "not UTF-8 text"),
                               (["\ufeff{}"], resume, "mark")] + [
            ([run, x], resume, why) for x, why in second_lines]:
        text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
        path.write_bytes(text.encode("utf-16" if "utf-16" in flags else "utf-8"))
        flags = [f for f in flags if f != "utf-16"]
        expect_exit_2(argv + SMALL + flags, said, capsys)
        assert path.read_bytes() in (text.encode("utf-8"), text.encode("utf-16"))
        assert os.listdir(tmp_path) == [path.name]


def test_a_folder_where_a_grid_writes_a_file_stops_it_and_resume_without_a_file_trains_all(
        tmp_path, capsys):
    T.test_a_folder_where_a_run_writes_a_file_stops_it_before_training(
        tmp_path, capsys, lambda argv: B.main(["--compare"] + argv))
    B.check_runs_file(str(tmp_path / "none.jsonl"), [], "cpu", "compare", True, None)
    assert "no finished run" in capsys.readouterr().out


def test_an_interrupted_grid_resumes_where_it_stopped(monkeypatch, capsys, tmp_path):
    # Ctrl-C after two runs: both are in OUT/compare.runs.jsonl (and a line cut short after
    # them is dropped); --resume trains only the others and writes what one uninterrupted
    # command writes; the file goes once the record is written.
    skip_rendering(monkeypatch)
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 1)
    argv = ["--compare", "--norms", "pre,post", "--regimes", "exact/cosine"] + SMALL
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    B.main(argv + ["--out", str(whole)])
    trained, real = [], B.train_and_evaluate

    def counted(cfg, *a, **k):
        if len(trained) == 2 and not resuming:
            raise KeyboardInterrupt
        trained.append(cfg)
        return real(cfg, *a, **k)
    monkeypatch.setattr(B, "train_and_evaluate", counted)
    resuming = False
    with pytest.raises(SystemExit):
        B.main(argv + ["--out", str(cut)])
    assert "--resume keeps the finished runs" in capsys.readouterr().err
    assert len(read(cut / "compare.runs.jsonl").splitlines()) == 2
    with open(cut / "compare.runs.jsonl", "a", encoding="utf-8") as f:
        f.write('{"config": {"vocab": 3')   # a third line, cut short by a kill: dropped
    resuming = True
    B.main(argv + ["--out", str(cut), "--resume"])
    assert len(trained) == 6 and not (cut / "compare.runs.jsonl").exists()
    report, (once, twice) = read(cut / "compare.md"), (load(d / "compare.json") for d in (whole,
                                                                                         cut))
    assert "worker process(es), 2 of them resumed from an interrupted command" in report
    assert "--resume" not in report.splitlines()[0]
    assert twice["runs"] == once["runs"] and twice["summary"] == once["summary"]


def test_the_eta_of_tuned_rates_counts_both_stages(monkeypatch, capsys):
    # 2 placements x 1 regime x 2 rates on the first seed, then 2 x 1 x 2 more seeds at the
    # chosen rates; every run "takes" 10 s in 1 worker, so after the first run 7 remain: 70 s.
    monkeypatch.setattr(B, "grid_workers", lambda runs, device: 1)
    metrics = {"length": [1, 2, 3], "tvd": [0.1, 0.2, 0.3]}
    monkeypatch.setattr(B, "train_and_evaluate", lambda cfg, *a, **k: (
        cfg, {"raw": metrics, "ema": metrics, "bema": metrics}, 10.0))
    base = R.Config(vocab=4, train_len=1, device="cpu")
    done, _, _, _ = B.tune_rates(base, ("pre", "post"), (("exact", "cosine"),), [1e-3, 1e-2],
                                 "cpu")
    etas = [line.rsplit("ETA ", 1)[1] for line in capsys.readouterr().out.splitlines()
            if "ETA" in line]
    assert len(done) == 8 and etas == ["70s", "60s", "50s", "40s", "30s", "20s", "10s", "0s"]


# ---- statistics ------------------------------------------------------------------------------
# The tests and intervals of the search and the suite against brute force and known values.
def test_search_statistics_and_the_paired_t_interval_match_brute_force_and_known_values():
    # Wilson 95 % interval of 8 of 10, from the formula by hand: 0.4902 .. 0.9433.
    assert B.wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    # Exact tests against counting all 2^n sign patterns: the share as far from the middle or more.
    def exact_p(weights, observed):
        mid = sum(weights) / 2
        return sum(abs(sum(w for w, s in zip(weights, signs) if s) - mid) >= abs(observed - mid)
                   for signs in itertools.product((0, 1), repeat=len(weights))) / 2**len(weights)
    for n in range(1, 9):
        for k in range(n + 1):
            assert B.sign_test(k, n) == pytest.approx(exact_p([1] * n, k))
    diffs = [0.5, -1.25, 2.0, 3.5, -0.25, 1.0, 4.0, -3.0]
    w = sum(r for r, d in enumerate(sorted(diffs, key=abs), start=1) if d > 0)   # signed ranks
    assert B.wilcoxon(diffs) == pytest.approx(exact_p(range(1, len(diffs) + 1), w))
    assert B.wilcoxon([1.0, 1.0, -1.0]) == pytest.approx(1.0)   # ties: ranks 2, 2, 2
    med, lo, hi = B.bootstrap_median((1.0, 2.0, 3.0, 4.0, 100.0), reps=2000)
    assert med == 3.0 and 1.0 <= lo <= med <= hi <= 100.0
    # Zeros (ties of the pair) are dropped by both tests: 6 zeros and 4 wins is 4 of 4.
    st = B.search_stats([(0.0, 0.01)] * 6 + [(0.5 + i, 0.01) for i in range(4)])
    assert st["sign_p"] == pytest.approx(B.sign_test(4, 4)) == pytest.approx(0.125)
    assert st["wilcoxon_p"] == pytest.approx(0.125) and st["post_wins"] == 4 and st["n"] == 10
    # Paired t interval of 1, 2, 3, 4, 5: mean 3, sd sqrt(2.5), 95 % t (4 df) 2.776 x sd / sqrt(5).
    m, lo, hi = B.mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0 and hi - m == pytest.approx(2.776 * math.sqrt(2.5 / 5), rel=1e-12)
    assert lo == pytest.approx(3.0 - 1.9630, abs=1e-4)       # by hand: 2.776 x 0.7071


# ---- --theory and --tables -------------------------------------------------------------------
# theory.md's closed forms drawn on the hand-built models; --tables checks its ROOT.
def test_the_lab_predicts_theory_md_s_margins_and_tvds_without_overflow():
    # --theory draws predicted_margin and predicted_tvd: Appendix C's margins (margin_c, written
    # from theory.md), with eps and at eps = 0, and section 2.4's pi, at every length.
    for v, norm, gamma, eps in itertools.product((5, 32), R.NORMS, (0.7, 1.0), (1e-5, 0.0)):
        for s in range(1, v):
            m = B.predicted_margin(v, norm, s, gamma, eps)
            assert m == pytest.approx(margin_c(v, norm, s, gamma, eps), rel=1e-12)
            assert B.predicted_tvd(v, s, m) == pytest.approx(pi(v, s, m), rel=1e-12)
    assert 0 <= B.predicted_tvd(1024, 900, 5000.0) < 1e-300   # e^-5000: 0 in float64
    assert 0 <= B.predicted_tvd(128, 119, 1e6) < 1e-300
    assert B.predicted_tvd(32, 5, 3.0) == pytest.approx(5 / (5 + 27 * math.exp(3.0)))
    assert B.predicted_tvd(32, 5, -1e6) == 1.0


def test_theory_draws_every_hand_built_model_on_its_formula(tmp_path, monkeypatch, capsys):
    # python plots/lab.py --theory: the four hand-built models of Part 1 against predicted_margin,
    # each scaled to margin 6 at s = L; the printed differences are float64's, theory.png written.
    skip_rendering(monkeypatch)
    B.main(["--theory", "--vocab", "10", "--train-len", "3", "--out", str(tmp_path)])
    lines = [x for x in capsys.readouterr().out.splitlines() if "largest relative" in x]
    assert [x.split()[0] for x in lines] == list(R.NORMS)
    assert all(float(x.rsplit(" ", 1)[1]) < 1e-9 for x in lines)
    at_1 = [B.predicted_margin(10, n, 1, 6 / B.predicted_margin(10, n, 3)) for n in R.NORMS]
    assert [x.split()[2] for x in lines] == [f"{m:.3f}" for m in at_1]
    assert os.listdir(tmp_path) == ["theory.png"]


def test_tables_refuses_a_root_or_out_it_cannot_use_before_writing(tmp_path, capsys):
    # --tables ROOT: a missing, empty or file ROOT, the repository root, a compare.json that is no
    # grid record, an ablation whose partner ran without --lrs, --out holding a file named mlp_norm.
    root, out = tmp_path / "r", tmp_path / "out"
    (tmp_path / "empty").mkdir()
    for argv, said in [(["nope"], "no depthN/compare.json"), ([str(tmp_path / "empty")], "no"),
                       ([os.path.join(HERE, "README.md")], "no depthN"), ([HERE], "no depthN")]:
        expect_exit_2(["--tables", *argv, "--out", str(out)], said, capsys)
    (root / "depth1").mkdir(parents=True)
    (root / "depth1" / "compare.json").write_text("[]", encoding="utf-8")
    expect_exit_2(["--tables", str(root), "--out", str(out)], "is not a record of", capsys)
    for name in ("depth1", "mlp_norm/layers1"):
        os.makedirs(root / name, exist_ok=True)
        (root / name / "compare.json").write_text(read("plots/compare.json"), encoding="utf-8")
    expect_exit_2(["--tables", str(root), "--out", str(out)], "a grid without --lrs", capsys)
    os.remove(root / "mlp_norm" / "layers1" / "compare.json")
    out.mkdir()
    (out / "mlp_norm").write_text("my notes", encoding="utf-8")
    expect_exit_2(["--tables", str(root), "--out", str(out)], "mlp_norm there is a file", capsys)
    assert os.listdir(out) == ["mlp_norm"]
    one = tmp_path / "one" / "depth4" / "seeds345-pre"   # the notebook's extra seeds, one placement
    one.mkdir(parents=True)
    (one / "compare.json").write_text(read("plots/depth4/seeds345-pre/compare.json"), "utf-8")
    expect_exit_2(["--tables", str(one.parent.parent)], "hold one placement (pre)", capsys)


def test_mlp_norm_table_leaves_out_a_regime_with_one_arm_in_one_line(tmp_path, capsys):
    # The ablation in one regime, the arm with the norm in two: one table row pair, one line.
    (tmp_path / "depth1").mkdir()
    (tmp_path / "depth1" / "compare.json").write_text(read("plots/depth1/compare.json"), "utf-8")
    ablation = load("plots/mlp_norm/layers1/compare.json")
    ablation["runs"] = [r for r in ablation["runs"] if r["config"]["targets"] == "sampled"]
    os.makedirs(tmp_path / "mlp_norm" / "layers1")
    (tmp_path / "mlp_norm" / "layers1" / "compare.json").write_text(json.dumps(ablation), "utf-8")
    B.mlp_norm_table(str(tmp_path))
    assert "one arm only in 1 layer(s), exact, cosine: left out" in capsys.readouterr().out
    rows = [r for r in read(tmp_path / "mlp_norm" / "mlp_norm.md").split("\n") if r[:4] == "| 1 "]
    assert [r.split(" | ")[1:3] for r in rows] == [["sampled, constant", "yes"],
                                                   ["sampled, constant", "no"]]


# ---- the command line ------------------------------------------------------------------------
# Bad input of every lab flag: one line, exit 2, before training; flags reach the grids.
LAB_BAD_INPUT = [   # argv, and after " | " the flag its one line names where that is not argv[0]
    "--vocab 8 | give one mode", "--task dyck --compare", "--compare --suite | --suite",
    "--theory --resume | --resume", "--compare --vocab 8 --train-len 4 | --train-len",
    "--save SAVE/m.pt --theory", "--compare --post-norm | --post-norm",
    "--compare --ema 0.9 | --ema", "--theory --steps 5 | --steps", "--suite --vocab 9 | --vocab",
    "--suite --train-len 1000 | --train-len", "--suite --train-len 1024 | --train-len",
    "--compare --steps 0 | --steps", "--compare --seed -1 | --seed",
    f"--suite --seed {2**32 - 4} | --seed", "--compare --attn-scale cubic | --attn-scale",
    "--compare --dropout 0.1 | --dropout", "--search 0", "--search 4 --vocab 8 | --vocab",
    "--search 4 --lrs 0.1,2 | --lrs", "--compare --lrs 0.1,0.1 | --lrs",
    "--compare --lrs x | --lrs", "--compare --norms pre,middle | --norms",
    "--compare --regimes sampled/linear | --regimes",
    "--theory --vocab 1024 --train-len 900 | --vocab", "--compare --no-mlp-norm | --no-mlp-norm",
    "--search 4 --mlp --no-mlp-norm | --no-mlp-norm", "--search 4 --mlp --lrs 0.01,0.1 | --lrs",
    "--tables", "--compare --ste 5 | --ste", "--compare --norm post | --norm",
    "--compare --out '' | --out",
    # the memory estimate of the suite: Dyck's evaluation's attention
    "--suite --train-len 256 --n-layer 16 --n-head 64 --n-embd 64 --batch-size 1 | --batch-size",
    f"--compare --device {'mps' if torch.cuda.is_available() else 'cuda'} | --device"]


@pytest.mark.parametrize("case", LAB_BAD_INPUT)
def test_bad_input_of_the_lab_exits_2_with_one_line_before_training(case, capsys, tmp_path):
    T.test_bad_input_exits_2_with_one_line_before_training(case, capsys, tmp_path, B.main)


def test_the_lab_s_help_names_only_flags_the_lab_takes(capsys):
    with pytest.raises(SystemExit):
        B.main(["--help"])
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))
    assert named - {"--help"} == {f[0] for f in B.FLAGS}   # and every one of them


def test_suite_honours_the_model_flags(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(B, "suite", lambda cfg, out, command, runs_file, **kw: seen.update(kw))
    B.main(["--suite", "--steps", "5", "--lr", "0.01", "--out", str(tmp_path)])
    assert seen == {"steps": 5, "lr": 0.01}
    assert {(c.steps, c.lr, c.vocab) for c in B.suite_grid(R.Config(), **seen)} == {(5, 0.01, 5)}


def test_the_lab_sets_the_thread_policy_as_the_reference_does(monkeypatch):
    T.test_the_thread_policy_is_set_by_the_script_not_by_an_import(monkeypatch, "plots/lab.py")


def test_a_closed_pipe_ends_quietly(tmp_path, monkeypatch, capsys):
    # python plots/lab.py --theory | head: the reader is gone. The script runs as __main__ in
    # this process (no second start of torch), printing into a pipe whose reading end is closed.
    read_end, write_end = os.pipe()
    os.close(read_end)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # restored afterwards
    monkeypatch.setattr(sys, "argv", ["plots/lab.py", "--theory", "--vocab", "4", "--train-len",
                                      "2", "--out", str(tmp_path)])
    with open(write_end, "w", buffering=1, encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        with pytest.raises(SystemExit) as stopped:
            runpy.run_path(os.path.join(HERE, "plots", "lab.py"), run_name="__main__")
        monkeypatch.undo()
    assert stopped.value.code == 1 and capsys.readouterr().err == ""


# ---- the documents quote the committed files -------------------------------------------------
# Each committed table is what its command writes; each quoted number is its JSON's; commands run.
@pytest.mark.parametrize("table", ["compare.md", "long/compare.md", "alternatives.md", "search.md",
                                   "suite.md", "tuned/compare.md", "search_tuned/search.md",
                                   "search_mlp/search.md"] + [
    os.path.relpath(p, os.path.join(HERE, "plots")) for d in ("depth*", "mlp_norm", "p12")
    for p in sorted(glob.glob(os.path.join(HERE, "plots", d, "**", "compare.md"), recursive=True))])


def test_each_committed_table_is_what_its_command_writes_from_its_json(table, tmp_path,
                                                                      monkeypatch, capsys):
    # Rerun the command named in the table's first line with run_grid answering from the
    # committed JSON instead of training: the code must write the committed table again.
    record = load(os.path.join("plots", table.replace(".md", ".json")))
    runs = {B.config(r["config"]): {k: v for k, v in r.items() if k != "config"}
            for r in record["runs"]}
    walls = [record["wall_seconds"]]   # the first grid's wall: the record's; a second one's: 0
    committed = read(os.path.join("plots", table))
    resumed = re.search(r", (\d+) of them resumed from an interrupted command", committed)

    def from_json(configs, device, averages=None, later=0, runs_file=None):
        if resumed:   # run_grid counts the runs it took from a runs file (--resume)
            runs_file.resumed = int(resumed.group(1))
        return [(c, runs[c], 0.0) for c in configs], walls.pop() if walls else 0.0, 2
    skip_rendering(monkeypatch)
    monkeypatch.setattr(B, "run_grid", from_json)
    command = committed.split("`")[1]
    B.main(shlex.split(command)[2:] + ["--out", str(tmp_path)])
    assert (tmp_path / os.path.basename(table)).read_text(encoding="utf-8") == committed


def flat(name):
    return " ".join(read(name).split())   # line breaks do not matter


def cell(summary, regime, norm, avg="ema", column="s = 24 (2 L)", over=mean):
    """One cell of a grid's summary: the mean over its seeds (over=list: each seed's value)."""
    return over(summary[regime][norm][avg][column])


def assert_quoted(fragments, name="plots/README.md"):
    text = flat(name)
    for fragment in fragments:
        assert fragment in text, fragment


def numbers_in(text):
    """Every maximal run of digits and decimal points counts as one number (1/s: one, 2 L: one,
    0.515: one); link targets and arXiv identifiers are addresses, not numbers."""
    text = re.sub(r"arXiv\s+\[?[\d.]+", "arXiv", re.sub(r"\]\([^)]*\)", "]", text))
    return re.findall(r"\d+(?:\.\d+)*", text)


SC, EC = "sampled, constant", "exact, cosine"   # the regimes the documents quote most
TRAIN, BEYOND = "training lengths", "mean, s = 13..31"   # columns of a grid's summary


def apart(lower, higher):   # outside seed noise: each seed of one arm below each of the other's
    return max(lower) < min(higher)


def seed_mean(curves):   # the mean over seeds of a curve, one value a length
    return [mean(c) for c in zip(*curves)]


def fit_cell(fit, at_2l):   # depth.md's and mlp_norm.md's: training TVD / 2 L (seeds' range)
    return f"{fit:.4f} / {mean(at_2l):.4f} ({min(at_2l):.3f} - {max(at_2l):.3f})"


def span(pair, dash="\u2013"):   # an interval as the documents write it: 0.81–1.22
    return f"{pair[0]:.2f}{dash}{pair[1]:.2f}"


def test_the_readme_front_door_is_short_in_order_and_grades_each_finding_on_one_scale():
    readme = read("README.md")
    opening = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", readme.split("\n## ", 1)[0].split("\n", 1)[1])
    assert len(opening.split()) <= 120
    said = " ".join(opening.split())
    assert said.index("**error**: the total variation distance (TVD)") < said.index("2 L = 24") < \
        said.index("0.094")   # it defines the error and 2 L before it claims
    assert len(numbers := re.findall(r"(?<![\w.])\d+\.\d+|\d+ %", said)) <= 4, numbers
    # it names the placements it speaks of, and which one is the paper's
    assert all(name in said for name in ("(`pre`, the theorem's model)", "(`post`, the paper's "
                                         "Post-Norm)", "(`pre-final`, GPT-2's final norm)"))
    # the first screen, lines 1-60: at most 40 numbers
    assert len(first_screen := numbers_in("\n".join(readme.splitlines()[:60]))) <= 40, first_screen
    headings = [line for line in readme.splitlines() if line.startswith("## ")]
    assert headings == ["## The task, by hand", "## The idea", "## Run it", "## Findings",
                        "## Install", "## Tests and flags", "## Exercises", "## Answers",
                        "## Using the pieces", "## Citation"]
    assert readme.splitlines().index("## Exercises") <= 140
    # Findings: at most 10 rows under three group rows; grades defined once above, strongest first.
    findings = readme.split("\n## Findings", 1)[1].split("\n## ", 1)[0]
    above = " ".join(findings.split("\n| ", 1)[0].split())
    rows = [ln.strip("| ").split(" | ") for ln in findings.splitlines() if ln.startswith("| ")]
    assert rows[0] == ["question", "answer", "evidence", "notebook"] and len(
        [r for r in rows if r[0].startswith("**")]) == 3   # the groups: | **name** | | | |
    rows = [r for r in rows[2:] if not r[0].startswith("**")]
    assert 3 < len(rows) <= 10
    strengths = ("strong", "moderate", "weak", "exploratory")
    assert all(f"**{word}**: " in above for word in strengths)
    notebook = flat("plots/README.md")
    for question, answer, evidence, link in rows:
        # the answer: one sentence of at most 250 characters with at most two numbers
        assert len(answer) <= 250 and len(numbers_in(answer)) <= 2, question
        sentence = re.sub(r"\d\.\d", "", answer)   # decimal points are not full stops
        assert sentence.endswith(".") and "." not in sentence[:-1], question   # one sentence
        assert len(evidence) <= 200 and not question.startswith("The same"), question
        words = [w for w in strengths if re.search(rf"\b{w}\b", evidence)]
        assert len(words) == 1 and evidence.startswith(f"**{words[0]}**: "), question
        assert link.startswith("[§") and question.endswith("?")
        # strong only on predictions the notebook calls held without a qualifier
        if words[0] == "strong":
            cited = re.findall(r"\bP(\d+[a-z]?)\b", evidence)
            assert cited and all(f"**P{n} held**" in notebook for n in cited), question
        if "P1 " in evidence:   # P1's earlier runs disclosed wherever P1 is cited
            assert "committed before P1 was written" in evidence, question


def test_every_relative_link_in_the_three_documents_resolves():

    def slug(heading):   # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    for doc in ("README.md", "theory.md", "plots/README.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", read(doc)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            assert os.path.exists(os.path.join(HERE, path)), (doc, target)
            if anchor:
                headings = [slug(line.lstrip("#")) for line in read(path).splitlines()
                            if line.startswith("#")]
                assert anchor in headings, (doc, target)


def test_notebook_tables_are_copied_from_the_generated_tables():
    generated = "".join(read(os.path.relpath(f, HERE)) for f in
                        glob.glob(os.path.join(HERE, "plots", "**", "*.md"), recursive=True)
                        if not f.endswith("README.md"))
    rows = [line for line in read("plots/README.md").splitlines()
            if re.match(r"\| (`|placement|Dyck|Shuffle|language|layers|rival|\d+ \|)", line)]
    assert len(rows) >= 20
    for row in rows:
        assert row in generated, row


def test_the_laws_in_the_trained_models_match_plots_compare_json():
    # Lab notebook, section 1 (and the README's idea): minima and maxima over all 31 lengths and
    # all 3 seeds of the EMA weights, sampled targets, constant rate.
    record, v = load("plots/compare.json"), 32
    summary = record["summary"]
    ema = {n: [r["ema"] for r in runs_of(record["runs"], SC, norm=n)] for n in R.NORMS}
    gap_s = [g * s for m in ema["pre"] for s, g in enumerate(m["logit_gap"], 1)]
    shape = [g * math.sqrt(s * (v - s)) / v for m in ema["post"]
             for s, g in enumerate(m["logit_gap"], 1)]
    entropy = {n: max(abs(h - math.log(s)) for m in ema[n]
                      for s, h in enumerate(m["attn_entropy"], 1)) for n in R.NORMS}
    assert max(gap_s) / min(gap_s) < 1.01 and max(shape) / ((max(shape) + min(shape)) / 2) < 1.03
    assert max(entropy[n] for n in ("pre", "pre-final", "post")) < 0.002
    seeds = {n: seed_mean(m["logit_gap"] for m in ema[n]) for n in ("pre", "post")}
    assert_quoted([f"its gap falls from {seeds['pre'][0]:.2f} at s = 1 to {seeds['pre'][30]:.2f} "
                   "at s = 31 (means over seeds)", "trained, it never falls below "
                   f"{math.floor(100 * min(seeds['post'])) / 100:.2f} (mean over seeds)",
                   f"`post-residual` up to {entropy['post-residual']:.3f} below"], "README.md")
    pre, post = (runs_of(record["runs"], SC, norm=n, seed=0)[0]["ema"]["logit_gap"]
                 for n in ("pre", "post"))
    # the trained delta predicts the error: pi(s) with each seed's mean gap x s
    predicted = seed_mean([s / (s + (v - s) * math.exp(sum(g * t for t, g in enumerate(
        m["logit_gap"], 1)) / 31 / s)) for s in range(1, 32)] for m in ema["pre"])
    measured = seed_mean(m["tvd"] for m in ema["pre"])
    order = ("post", "pre-final", "post-residual", "pre")
    means = [cell(summary, SC, n, column=BEYOND) for n in order]
    at_2l = [cell(summary, SC, n) for n in order]
    assert means == sorted(means) and at_2l == sorted(at_2l)
    assert_quoted([
        f"gap × s between {min(gap_s):.2f} and {max(gap_s):.2f} over $s = 1..31$, constant to "
        "within 1 %",
        f"between {min(shape):.3f} and {max(shape):.3f} over $s = 1..31$ (within ±3 %",
        f"`post-residual`: up to {entropy['post-residual']:.3f} nats below",
        f"seed 0: gap {pre[0]:.2f} at $s = 1$, {pre[11]:.2f} at $s = 12$, {pre[30]:.2f} at "
        "$s = 31$", f"seed 0: {post[0]:.2f} at $s = 1$, {post[11]:.2f} at $s = 12$, {post[30]:.2f} "
        f"at $s = 31$, never below {min(post):.2f}",
        f"$\\pi(s)$ gives {predicted[30]:.3f} at $s = 31$ and {mean(predicted[12:]):.3f} over "
        f"$s = 13..31$; the models measure {measured[30]:.3f} and {mean(measured[12:]):.3f}",
        "mean TVD over $s = 13..31$: " + ", ".join(f"{x:.3f}" for x in means) + "; at 2 L: "
        + ", ".join(f"{x:.4f}" for x in at_2l),
        f"the grid itself took {record['wall_seconds']:.0f} s"])
    at = lambda norm, avg, col: f"{cell(summary, SC, norm, avg, col):.4f}"  # noqa: E731
    assert_quoted([f"`post` {at('post', 'raw', TRAIN)} \u2192 {at('post', 'ema', TRAIN)}",
                   f"`pre` {at('pre', 'raw', TRAIN)} \u2192 {at('pre', 'ema', TRAIN)}",
                   f"s = 13..31: {at('post', 'raw', BEYOND)} \u2192 {at('post', 'ema', BEYOND)}",
                   f"raises `pre`'s ({at('pre', 'raw', BEYOND)} \u2192 {at('pre', 'ema', BEYOND)})",
                   f"all four placements (`post` {at('post', 'bema', BEYOND)})",
                   "and is far worse with exact targets, except for `pre`"])
    # "as in every regime": the EMA raises pre's extrapolation TVD in all four regimes
    assert all(cell(summary, r, "pre", "ema", BEYOND) > cell(summary, r, "pre", "raw", BEYOND)
               for r in summary)
    # "BEMA beats the EMA there for all four placements"
    assert all(cell(summary, SC, n, "bema", BEYOND) < cell(summary, SC, n, "ema", BEYOND)
               for n in R.NORMS)
    # "and is far worse with exact targets, except for `pre`"
    for regime in ("exact, constant", EC):
        ema_bema = {n: (cell(summary, regime, n, "ema", BEYOND),
                        cell(summary, regime, n, "bema", BEYOND)) for n in R.NORMS}
        assert all(b > 3 * e for n, (e, b) in ema_bema.items() if n != "pre")
        assert ema_bema["pre"][1] < ema_bema["pre"][0]


def test_the_readme_findings_match_their_json():
    compare = load("plots/compare.json")
    summary, lower = compare["summary"], {}
    # post against pre-final at 2 L: outside seed noise in every regime, and the order flips
    for regime in summary:
        post, final = (cell(summary, regime, n, over=list) for n in ("post", "pre-final"))
        assert max(statistics.stdev(post), statistics.stdev(final)) < 0.001
        assert apart(post, final) or apart(final, post)
        lower[regime] = "post" if apart(post, final) else "pre-final"
    assert lower == {SC: "post", "sampled, cosine": "post", "exact, constant": "pre-final",
                     EC: "pre-final"}
    post, final = (cell(summary, "exact, constant", n, over=list) for n in ("post", "pre-final"))
    sd = math.sqrt((statistics.variance(post) + statistics.variance(final)) / 2)   # pooled
    assert_quoted(["each regime's order is outside seed noise by that rule", "constant rate `post` "
                   f"and `pre-final` are {(mean(post) - mean(final)) / sd:.1f} pooled standard "
                   f"deviations apart ({mean(post):.4f} against {mean(final):.4f})"])
    assert all(max(R.NORMS, key=lambda n: cell(summary, r, n)) == "pre" for r in summary)
    assert all(cell(summary, r, "pre-final") < cell(summary, r, "post") for r in summary
               if "exa" in r)
    ratios = [cell(summary, SC, n, "raw", TRAIN) / cell(summary, SC, n, "ema", TRAIN)
              for n in R.NORMS]
    assert round(min(ratios)) == 3 and round(max(ratios)) == 6
    P, A = (load("plots/search.json")["summary"][n]["ema"]["all"] for n in ("pre-final", "pre"))
    S = load("plots/search_tuned/search.json")["summary"]["pre-final"]["ema"]["all"]
    tuned, long = load("plots/tuned/compare.json"), load("plots/long/compare.json")["summary"]
    # "outside seed noise": every seed of the lower arm below every seed of the other
    seeds_4l = {(r, n): cell(long, r, n, column="s = 60 (4 L)", over=list)
                for r in (SC, EC) for n in ("pre", "pre-final", "post")}
    at_4l = {n: mean(seeds_4l[SC, n]) for n in ("pre", "pre-final", "post")}
    assert at_4l["post"] < at_4l["pre-final"] < at_4l["pre"]
    assert apart(seeds_4l[SC, "post"], seeds_4l[SC, "pre-final"])
    assert apart(seeds_4l[SC, "pre-final"], seeds_4l[SC, "pre"])
    assert all(apart(seeds_4l[EC, "pre-final"], seeds_4l[EC, n]) for n in ("pre", "post"))
    assert all(cell(long, EC, "pre-final", column=c) < cell(long, EC, n, column=c)
               for c in long[EC]["pre"]["ema"] for n in ("pre", "post"))
    assert apart(*(cell(tuned["summary"], SC, n, over=list) for n in ("pre-final", "post")))
    bos, plain = (next(line for line in read("plots/alternatives.md").splitlines()
                       if line.startswith(f"| {name} | EMA 0.999 |")).split(" | ")[3]
                  .split(" +- ")[0] for name in ("pre + BOS", "pre"))
    bos_seeds, pre_seeds = ([mean(r["ema"]["tvd"][12:]) for r in runs_of(
        load("plots/alternatives.json")["runs"], norm="pre", bos=b, dropout=0.0,
        attn_scale="none")] for b in (True, False))
    assert len(bos_seeds) == len(pre_seeds) == 3 and apart(bos_seeds, pre_seeds)
    suite = [line for line in read("plots/suite.md").splitlines() if "` - `post` |" in line]
    assert len(suite) == 4 and all(line.endswith("| no |") for line in suite)
    assert all(line.split(" | ")[3].startswith("+") for line in suite)   # post lowest on average
    # P1's runs committed before P1: every run with sampled targets and a constant rate, and post's
    runs = compare["runs"]
    before = [r for r in runs if r in runs_of(runs, SC) or r["config"]["norm"] == "post"]
    assert_quoted([f"but {len(before)} of its {len(runs)} runs were committed before P1 was "
                   f"written; `post` below `pre` in {A['post_wins']} of {A['n']} searched"],
                  "README.md")
    assert A["post_wins"] == A["n"] == 40
    assert_quoted([f"{len(before)} of the {len(runs)} runs of `--compare`", f"{len(before)} of the "
                   f"{len(runs)} runs were committed before P1: every run with sampled targets and "
                   "a constant rate, and `post`'s in the other regimes"])
    findings = flat("README.md").split("## Findings", 1)[1].split("## Tests and flags", 1)[0]
    for fragment in [
            "it cuts the training-length TVD 3 to 6 times",
            f"`post` {at_4l['post']:.2f}, `pre` {at_4l['pre']:.2f}, `pre-final` between",
            "a BOS sink helps a little (mean TVD beyond the training lengths "
            f"{bos} against {plain})",
            "no difference is distinguishable from seed noise, not even against `pre`"]:
        assert fragment in findings, fragment
    assert P["median_ratio_95"][0] < 1 < P["median_ratio_95"][1]   # "no difference is detectable"
    assert S["median_ratio_95"][0] < 1 < S["median_ratio_95"][1]
    chosen = {k.split(",")[0]: lr for k, lr in tuned["chosen_lr"].items()}
    seed0 = {(r["config"]["norm"], r["config"]["lr"]): r["ema"]["tvd"][23]
             for r in runs_of(tuned["runs"], SC, seed=0)}
    below = [x for (n, lr), x in seed0.items() if n == "post" and lr < chosen["post"]]
    assert len(below) == 4 and max(below) < seed0["pre-final", chosen["pre-final"]]
    assert_quoted(["on seed 0 each of its four lower rates is below `pre-final` at its chosen "
                   f"rate: {min(below):.3f} to {max(below):.3f} against "
                   f"{seed0['pre-final', chosen['pre-final']]:.3f})"])
    t_post, t_final = (seed_mean(r["ema"]["tvd"] for r in runs_of(
        tuned["runs"], SC, norm=n, lr=chosen[n])) for n in ("post", "pre-final"))   # chosen rates
    final, post = (cell(tuned["summary"], SC, n) for n in ("pre-final", "post"))
    assert_quoted([
        "The chosen rates differ: " + ", ".join(f"{chosen[n]:g} (`{n}`)"
                                                for n in ("pre", "pre-final", "post")),
        f"within a factor {post / final:.2f} ({final:.4f} and {post:.4f}, in `pre-final`'s favour)",
        f"`post` is below `pre-final` from $s = {tuned['summary'][SC]['crossover']['ema']}$ and at "
        f"$s = 31$ ({t_post[30]:.3f} against {t_final[30]:.3f})"])


def documented_commands():
    """(document, program, argv) of every `python resharpen.py ...` and `python plots/lab.py ...`
    in the three documents, in backticks or code blocks; not in the pre-registered **Protocol
    paragraphs (quoted as committed) nor the old spellings the notebook maps (`old`, now `new`)."""
    for doc in ("README.md", "theory.md", "plots/README.md"):
        text = "\n\n".join(p for p in read(doc).split("\n\n") if not p.startswith("**Protocol"))
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        flat = " ".join(re.sub(r"```[a-z]*\n.*?```", " ", text, flags=re.S).split())
        found = re.findall(r"`(python (?:resharpen|plots/lab)\.py[^`]*)`(?!, now)", flat) + [
            line.split("#")[0] for b in blocks for line in b.splitlines()
            if line.startswith(("python resharpen.py", "python plots/lab.py"))]
        for command in found:
            yield doc, *shlex.split(command)[1:2], shlex.split(command)[2:]


def p12(setting, at=lambda tvd: tvd[23]):   # {placement: at(each seed's EMA TVDs)}, seeds 100-105
    seeds = {}
    for first in (100, 103):
        runs = load(f"plots/p12/{setting}{first}/compare.json")["runs"]
        assert [r["config"]["seed"] for r in runs] == [first, first + 1, first + 2] * 3
        assert {r["config"]["mlp"] for r in runs} == {setting == "mlp"}
        for r in runs:
            seeds.setdefault(r["config"]["norm"], []).append(at(r["ema"]["tvd"]))
    return seeds


def test_p12_is_graded_by_its_rules_and_quoted_from_its_records():
    # The verdict of each part follows from the records by P12's rules; the seeds were fresh; the
    # notebook's table and the README quote the records.
    others = "".join(read(f) for f in glob.glob("plots/**/*.json", root_dir=HERE, recursive=True)
                     if "p12" not in f)
    assert not {int(s) for s in re.findall(r'"seed": (\d+)', others)} & set(range(100, 106))
    a, b = p12("attn"), p12("mlp")
    ratio = lambda x, y: mean(x) / mean(y)  # noqa: E731
    held = {"a": apart(a["post"], a["pre"]) and ratio(a["pre"], a["post"]) >= 3,
            "b": apart(a["pre-final"], a["pre"]) and ratio(a["pre"], a["pre-final"]) >= 3 and max(
                ratio(a["post"], a["pre-final"]), ratio(a["pre-final"], a["post"])) <= 1.5,
            "c": apart(b["pre"], b["pre-final"] + b["post"]) and min(
                mean(b["pre-final"]), mean(b["post"])) >= 1.5 * mean(b["pre"])}
    assert_quoted([f"**P12{k} {'held' if ok else 'failed'}**" for k, ok in held.items()])
    spread = lambda xs: f"{mean(xs):.4f} ({min(xs):.4f} - {max(xs):.4f})"  # noqa: E731
    assert_quoted([f"| {k} | {' | '.join(spread(s[n]) for n in ('pre', 'pre-final', 'post'))} |"
                   for k, s in (("A", a), ("B", b))])
    assert apart(a["post"], a["pre-final"]) and mean(b["post"]) < mean(b["pre-final"])
    assert_quoted([f"ratio {ratio(a['pre'], a['post']):.2f}", "`post` below `pre-final` on every",
                   f"ratio {ratio(a['pre'], a['pre-final']):.2f}",
                   f"factor {ratio(a['pre-final'], a['post']):.2f}",
                   f"its largest, {max(b['pre']):.4f} on seed {100 + b['pre'].index(max(b['pre']))}",
                   f"means, `post`'s, {ratio(b['post'], b['pre']):.2f} times `pre`'s"])
    fit, mid = (p12("mlp", f) for f in (lambda tvd: mean(tvd[:12]), lambda tvd: tvd[17]))
    curve = {n: seed_mean(c) for n, c in p12("mlp", list).items()}   # exploratory: B at every s
    assert [s for s in range(31) if curve["pre"][s] < min(curve["pre-final"][s], curve["post"][s])
            ] == list(range(20, 31)) and all(max(x, key=lambda n: mean(x[n])) == "pre" for x in (
                fit, mid))
    assert_quoted(["from s = 21 to 31, but on the training lengths ({:.4f}, against {:.4f} for "
                   "`pre-final` and {:.4f} for `post`) and at 1.5 L ({:.4f}, against {:.4f} and "
                   "{:.4f}) it is".format(*(mean(x[n]) for x in (fit, mid) for n in B.SEARCH_ARMS))])
    assert_quoted([f"is {mean(a['post']):.3f} with `post`, {mean(a['pre']):.3f} with `pre`, on six",
                   f"`pre` {mean(a['pre']):.3f}, `post` {mean(a['post']):.3f}, every seed apart",
                   f"({mean(a['post']):.3f} against {mean(a['pre-final']):.3f} on fresh"], "README.md")


def test_every_command_in_the_documents_is_accepted_by_its_program(tmp_path, monkeypatch):
    # Parsed and checked as each program checks its input (into a scratch --out and --save).
    monkeypatch.chdir(HERE)   # the commands run from the repository root
    commands, had_runs = list(documented_commands()), os.path.exists("runs")
    assert len(commands) >= 20 and {p for _, p, _ in commands} == {"resharpen.py", "plots/lab.py"}
    for doc, program, argv in commands:   # --out: given or not, a scratch folder, not runs/
        argv = [str(tmp_path / f"{i}.pt") if i and argv[i - 1] == "--save" else str(tmp_path) if i
                and argv[i - 1] == "--out" else a for i, a in enumerate(argv)]
        argv += ["--out", str(tmp_path)] * bool(argv and "--out" not in argv)
        if program == "resharpen.py":
            parser = R.build_parser()
            check = R.check_args
        else:
            parser = R.build_parser(B.FLAGS, [{f"--{m}" for m in B.MODE_FLAGS}], B.__doc__, "--norms")
            check = B.check_args
        parser.error = lambda msg: pytest.fail(f"{doc}: python {program} {shlex.join(argv)}: {msg}")
        if argv and "--help" not in argv:   # --help prints the flags and exits 0
            check(parser.parse_args(argv), parser)
    assert os.path.exists("runs") == had_runs   # nothing written into the checkout's runs/


@pytest.mark.parametrize("doc", ["theory.md", "README.md"])
def test_theory_md_names_the_file_of_each_lab_flag_name_and_test_it_cites(doc):
    # A flag or name only the lab has is called the lab's, or plots/lab.py's, within its sentence;
    # every flag is one of a program's; every test is where the claims table says (†: the lab's).
    # (The notebook, plots/README.md, is the lab's; its commands are checked above.)
    text = " ".join(read(doc).split())
    ours, labs = {f[0] for f in R.FLAGS}, {f[0] for f in B.FLAGS}
    for m in re.finditer(r"`(--[a-z-]+)", text):
        assert m.group(1) in ours | labs, m.group(1)
        if m.group(1) not in ours:
            assert "lab" in text[max(0, m.start() - 60):m.end() + 60], text[m.start() - 60:m.end()]
    for m in re.finditer(r"`([A-Za-z_]\w*)(?=[(`]|\.[a-z_]\w*[(`])(?!\.(md|py|json)`)", text):
        if hasattr(B, m.group(1)) and not hasattr(R, m.group(1)):
            assert "lab" in text[max(0, m.start() - 60):m.end() + 60], text[m.start() - 60:m.end()]
    for name, mark in re.findall(r"`(test_\w+)`(†?)", text):
        assert callable(getattr(sys.modules[__name__] if mark else T, name, None)), name


def test_no_command_in_the_documents_writes_over_the_committed_plots():
    # A reader who reruns a command to check it must not overwrite the table it is compared
    # with: commands write into runs/NAME. The notebook's protocols (paragraphs that open with
    # **Protocol) were committed before their runs and are quoted as written.
    for doc in ("README.md", "theory.md", "plots/README.md"):
        text = " ".join(p for p in read(doc).split("\n\n") if not p.startswith("**Protocol"))
        text = " ".join(text.split())
        folders = re.findall(r"--out[ =]([^\s`]+)", text)
        assert all(f.startswith("runs/") or f == "handout" for f in folders), (doc, folders)
        assert not re.search(r"\('plots'\)", text), doc   # B.depth_sweep('plots') and the like
    assert len(re.findall(r"--out runs/", flat("plots/README.md"))) >= 12


def test_readme_main_command_output_is_what_plots_metrics_json_holds():
    m = load("plots/metrics.json")
    assert m["config"]["norm"] == "post" and m["config"]["ema"] == 0.999   # the main command
    readme = read("README.md")
    assert R.format_table(m, m["config"]["train_len"], m["raw"]) in readme
    s, r = m["summary"], m["raw"]["summary"]
    assert (f"mean TVD: training lengths {s['tvd_train']:.4f} | extrapolation 13..31 "
            f"{s['tvd_extrap']:.4f}   (raw weights: {r['tvd_train']:.4f} | "
            f"{r['tvd_extrap']:.4f})") in readme


def test_depth_table_and_notebook_numbers_match_the_depth_grids(tmp_path, monkeypatch):
    # Notebook section 6 and the README against the grids (P8: depthN/compare.json's 3 seeds, [:3])
    skip_rendering(monkeypatch)
    B.depth_sweep(os.path.join(HERE, "plots"), str(tmp_path))
    assert read(tmp_path / "depth.md") == (table := read("plots/depth.md"))
    norms, records = ("pre", "pre-final", "post"), {}
    runs, ratios, paired, ats, outside = {}, [], {}, {}, 0
    signed = lambda x: "{:+.3f} ({:+.3f} to {:+.3f})".format(*x)  # noqa: E731
    for d in (1, 2, 3, 4):
        record = records[d] = load(f"plots/depth{d}/compare.json")
        more = glob.glob(os.path.join(HERE, f"plots/depth{d}/*/compare.json"))
        for r in record["runs"] + sum((load(p)["runs"] for p in sorted(more)), []):
            at_chosen = r["config"]["lr"] == record["chosen_lr"][grid_key(r)]
            assert at_chosen or r in record["runs"]   # seeds added later: at the chosen rate
            if at_chosen:
                seed = {"seed": r["config"]["seed"]}
                runs.setdefault((d, grid_key(r)), []).append(r["ema"] | seed)
    for d, regime in itertools.product((1, 2, 3, 4), (SC, EC)):   # depth.md's rows, seeds paired
        rs = {n: runs[d, f"{n}, {regime}"] for n in norms}
        assert all([m["seed"] for m in x] == list(range(len(x))) for x in rs.values())
        ats[d, regime] = at = {n: [m["tvd"][23] for m in x] for n, x in rs.items()}
        fit = {n: mean([mean(m["tvd"][:12]) for m in x]) for n, x in rs.items()}
        ratios.append(mean(at[nxt := min(norms[1:], key=lambda n: mean(at[n]))]) / mean(at["pre"]))
        paired[d, regime] = B.mean_interval([a - b for a, b in zip(at["pre"], at[nxt])])
        assert mean(at["pre"]) < mean(at[nxt]) and paired[d, regime][2] < 0   # outside, paired
        outside += (is_apart := all(apart(at["pre"], at[n]) for n in norms[1:]))
        assert (f"| {d} | {regime} | {len(at['pre'])} | "
                + " | ".join(fit_cell(fit[n], at[n]) for n in norms) + " | `pre` | "
                + f"{'outside' if is_apart else 'within'} | {signed(paired[d, regime])} |") in table
    dev = {(d, key, i): seed_mean([h - u for h, u in zip(m.get(   # mean of 3 seeds
        f"attn_entropy_layer{i}", m["attn_entropy"]), m["log_positions"])] for m in ms[:3])
           for (d, key), ms in runs.items() for i in range(1, d + 1)}
    assert all(-min(v) <= (0.07 if d == 1 else 0.15) for (d, _, i), v in dev.items() if i == 1)
    focus = {k: max(-dev[(*k, i)][23] for i in range(2, k[0] + 1)) for k in runs if k[0] > 1}
    spared = [focus.pop((d, "pre-final, " + SC)) for d in (2, 4)]   # P10's exception: not at 3
    assert min(focus.values()) > 0.5 and max(spared) <= 0.08
    assert round(max(-min(v) for (d, _, i), v in dev.items() if i > 1 and d in (2, 4)), 1) == 3.4
    # Not at every length: sampled, pre-final below pre; exact, s = 31: post lowest at 1-3 layers
    curve = lambda d, key, k=6: seed_mean(m["tvd"] for m in runs[d, key][:k])  # noqa: E731
    for d, k, below in ((1, 3, range(1, 20)), (2, 3, range(1, 15)), (4, 3, range(2, 21)),
                        (4, 6, [*range(2, 6), *range(15, 20)])):   # P8 on 3 seeds, P10 on 6
        pre, final = (curve(d, f"{n}, {SC}", k) for n in ("pre", "pre-final"))
        assert [s for s in range(1, 32) if final[s - 1] < pre[s - 1]] == list(below)
    assert all(min(norms, key=lambda n: curve(d, f"{n}, {EC}")[30]) == "post" for d in (1, 2, 3))
    A, s31 = ats[4, SC], {n: [m["tvd"][30] for m in runs[1, f"{n}, {SC}"]] for n in norms}
    first = lambda k: B.mean_interval([a - b for a, b in zip(A["pre"][:k], A["pre-final"])])  # noqa
    four = [", ".join(f"{mean(c[:12]):.4f} / {c[23]:.4f}{f' (`{n}`)' * (r == SC)}" for n in norms
                      for c in [curve(4, f"{n}, {r}", 3)]) for r in (SC, EC)]   # P8: 3 seeds
    post = sorted(mean(m["tvd"][:12]) for m in runs[4, "post, " + EC])   # two of six fail to fit
    seconds = [load(p)["wall_seconds"] for p in more]   # depth4's folders
    t = lambda x: signed(x).replace("-", "−")  # noqa: E731
    ti = lambda x: "is " + t(x).replace(" (", ", 95 % t interval ").rstrip(")") + ", excluding 0"
    walls = {d: records[d]["wall_seconds"] for d in records}
    assert_quoted([
        *(f"--out runs/depth{d}`: 30 runs, {walls[d] / 60:.0f} min" for d in (1, 2, 3)),
        f"--out runs/depth4`: 30 runs, {walls[4] / 3600:.1f} h", "noise in 7 of the 8 (the eighth",
        f"{four[0]} with sampled targets and a constant rate; {four[1]} with exact targets",
        f"The 30 runs took {walls[4] / 3600:.1f} hours", "is " + t(paired[4, EC]),
        f"by {min(ratios):.2f} to {max(ratios):.2f} times the next placement",
        f"{min(seconds):.0f} to {max(seconds):.0f} s of wall each",
        "(on the first three seeds it was " + t(first(3)).split("(")[1],
        ti(first(5)), ti(paired[4, SC]), f"({max(A['pre'][:5]):.3f} against "
        f"{min(A['pre-final'][:5]):.3f}): outside by both rules", f"(`pre`'s seed 5, "
        f"{A['pre'][5]:.3f}, is above `pre-final`'s best, {min(A['pre-final']):.3f})",
        f"(`post`'s worst seed {max(s31['post']):.4f}, `pre-final`'s best "
        f"{min(s31['pre-final']):.4f})",
        f"({mean(s31['post']):.4f} against {mean(s31['pre-final']):.4f})",
        f"worst ({mean(curve(1, 'pre, ' + SC)[:12]):.4f} against "
        f"{mean(curve(1, 'pre-final, ' + SC)[:12]):.4f};",
        "layers 2–4 focus, down to 3.4 nats below $\\log s$, except with `pre-final` and "
        "sampled targets, where every layer stays within 0.11 nats"])
    assert outside == 7 and len(seconds) == 6 and post[4] > 5 * post[3] and len(post) == 6
    assert apart(A["pre"][:5], A["pre-final"][:5]) and apart(s31["post"], s31["pre-final"])
    at_rate, best = {}, {}   # seed 0 at every rate (depth.md's second table), from the JSON
    for d, record in records.items():
        for r in runs_of(record["runs"], seed=0):
            c, x = r["config"], r["ema"]["tvd"][23]
            at_rate.setdefault((d, f"{c['targets']}, {c['lr_schedule']}", c["lr"]), {})[
                c["norm"]] = x
            by_norm = best.setdefault((d, c["targets"]), {})
            by_norm[c["norm"]] = min(x, by_norm.get(c["norm"], 1))
    lowest = Counter(min(t, key=t.get) for t in at_rate.values())
    oracle = [min(t, key=t.get) for t in best.values()]
    assert len(at_rate) == 24 and oracle.count("pre") == 7
    assert best[1, "sampled"]["post"] < best[1, "sampled"]["pre"]
    assert "| 1 | sampled, constant | 0.001 | 0.2821 | 0.3235 | 0.1317 |" in table
    assert_quoted([f"`pre` has the lowest TVD at 2 L in {lowest['pre']} of the 24 cases",
                   f"`post` in {lowest['post']} and `pre-final` in {lowest['pre-final']}",
                   "`pre` is lowest in 7 of the 8", f"({best[1, 'sampled']['post']:.4f}) is below "
                   f"`pre`'s lowest ({best[1, 'sampled']['pre']:.4f}, at its chosen 0.00316)"])
    assert_quoted([f"outside seed noise in {outside} of 8 cases; at one shared rate lowest in "
                   f"{lowest['pre']} of 24"], "README.md")


def test_mlp_norm_table_and_notebook_section_10_match_the_ablations_json(tmp_path, monkeypatch):
    # P11's ablation: pre with its MLP norm (plots/depthN) and without (plots/mlp_norm/layersN)
    skip_rendering(monkeypatch)
    B.mlp_norm_table(os.path.join(HERE, "plots"), str(tmp_path))
    assert read(tmp_path / "mlp_norm.md") == read("plots/mlp_norm/mlp_norm.md")
    arm, rows = {}, []
    for d, normed, path in [(d, n, p) for d in (1, 2) for n, p in (
            ("with", f"plots/depth{d}"), ("without", f"plots/mlp_norm/layers{d}"))]:
        record = load(path + "/compare.json")
        for r in runs_of(record["runs"], norm="pre"):
            if r["config"]["lr"] == record["chosen_lr"][grid_key(r)]:
                arm.setdefault((d, grid_key(r)[5:], normed), []).append(r["ema"])
    fit = {k: mean([mean(m["tvd"][:12]) for m in ms]) for k, ms in arm.items()}
    at = {k: [m["tvd"][23] for m in ms] for k, ms in arm.items()}
    gap_s = lambda ms, s: mean([m["logit_gap"][s - 1] * s for m in ms])  # noqa: E731
    gs = {k: [gap_s(ms, 12), gap_s(ms, 24)] for k, ms in arm.items()}
    rho = {k: g[1] / g[0] for k, g in gs.items()}
    flat_s, ex = ([gap_s(arm[1, r, "without"], s) for s in range(1, 32)] for r in (SC, EC))
    for d, r in itertools.product((1, 2), (SC, EC)):
        w, wo = (d, r, "with"), (d, r, "without")
        assert len(at[w]) == len(at[wo]) == 3 and apart(at[w], at[wo])   # outside seed noise
        rows += [f"| {d} | {r} | {'yes' if k == w else 'no'} | {fit_cell(fit[k], at[k])} | outside"
                 for k in (w, wo)]
    other = {"with": "without", "without": "with"}
    worse = [k for k in fit if fit[k] > 2 * fit[(*k[:2], other[k[2]])]]
    one, one_bare = (1, SC, "with"), (1, SC, "without")   # one layer, sampled, constant
    two, two_bare = (2, EC, "with"), (2, EC, "without")   # two layers, exact, cosine
    assert worse == [two_bare] and rho[one] > 1.25 and rho[1, EC, "with"] > 1.25
    assert all(0.8 <= rho[1, r, "without"] <= 1.25 for r in (SC, EC))
    assert f"{gs[one_bare][1]:.2f}" == f"{gs[one_bare][0]:.2f}"   # flat: 1/s
    assert_quoted(rows + [
        f"(training TVD {fit[two_bare]:.4f} against {fit[two]:.4f}, "
        f"{fit[two_bare] / fit[two]:.1f} times)",
        f"{mean(at[one_bare]) / mean(at[one]):.1f} times ({mean(at[one_bare]):.4f})",
        f"(at one layer, sampled: {min(at[one_bare]):.3f} to {max(at[one_bare]):.3f} against "
        f"{min(at[one]):.3f} to {max(at[one]):.3f})",
        f"exact targets {mean(at[1, EC, 'without']):.4f}",
        f"is flat with sampled targets ({min(flat_s):.2f} to {max(flat_s):.2f} over s = 1 to 31",
        f"falls by {100 * (1 - ex[-1] / ex[0]):.0f} % ({ex[0]:.2f} at s = 1 to {ex[-1]:.2f} at "
        "s = 31)", f"{gs[one][0] / 12:.2f} at L to {gs[one][1] / 24:.2f} at 2 L",
        f"is sqrt(24 / 8) / sqrt(12 / 20) = {math.sqrt(24 / 8) / math.sqrt(12 / 20):.2f}",
        *(f"10 runs, {load(f'plots/mlp_norm/layers{d}/compare.json')['wall_seconds']:.0f} s"
          for d in (1, 2))])
    assert_quoted([f"its TVD rises from {mean(at[one]):.3f} to {mean(at[one_bare]):.3f};",
                   f"with exact targets gap × s falls {100 * (1 - ex[-1] / ex[0]):.0f} %"],
                  "README.md")
    q = {k: f"{v:.2f}" for k, v in rho.items()}
    assert_quoted([f"{q[one]} and {q[1, EC, 'with']} with the norm, {q[one_bare]} and "
                   f"{q[1, EC, 'without']} without", f"({q[2, SC, 'with']}, {q[two]}); without "
                   f"it {q[2, SC, 'without']} with sampled targets",
                   f"and {q[two_bare]} with exact targets"])


SPLITS = {"v": "$v$", "L / v": "$L/v$", "heads": "heads", "lr": "learning rate", "batch": "batch",
          "steps": "steps"}   # search_losses' settings, as the notebook names them


def search_record(folder, *drawn):
    """plots/FOLDERsearch.json, its groups as search_configs(*drawn) draws them, runs by config."""
    record = load(f"plots/{folder}search.json")
    configs, groups = [B.config(r["config"]) for r in record["runs"]], B.search_configs(*drawn)
    assert configs == [c for group in groups for c in group]
    return record, groups, dict(zip(configs, record["runs"]))


def paired(st, wins="post_wins", p=".2f", full=False):
    """A search's result as the notebook words it: "W of N (p = ...; median ratio ..." (the
    sentence goes on), or in full, with both tests and both 95 % intervals."""
    if not full:
        return (f"{st[wins]} of {st['n']} (p = {st['sign_p']:{p}}; median ratio "
                f"{st['median_ratio']:.2f}")
    return (f"{st[wins]} of {st['n']} (95 % interval {span(st['win_rate_95'], ' - ')}; sign test "
            f"p = {st['sign_p']:{p}}, Wilcoxon p = {st['wilcoxon_p']:{p}}; median ratio "
            f"{st['median_ratio']:.2f}, interval {span(st['median_ratio_95'], ' - ')})")


def test_notebook_search_numbers_match_plots_search_json():
    record, groups, results = search_record("", B.SEARCH_N, 0)
    h = record["summary"]
    P, Q, A = h["pre-final"]["ema"]["all"], h["pre-final"]["raw"]["all"], h["pre"]["ema"]["all"]
    splits = ", ".join(f"{SPLITS[row[0]]} {row[2].split(' of ')[0]} | {row[3].split(' of ')[0]}"
                       for row in (line.strip("| ").split(" | ")
                                   for line in B.search_losses(groups, results)[2:]))
    assert P["n"] == B.SEARCH_N
    assert_quoted([
        f"`python plots/lab.py --search {B.SEARCH_N} --out runs/search`",
        "won " + paired(P, full=True),
        f"to at most {100 * (P['median_ratio_95'][1] - 1):.1f} % in `post`'s favour and at most "
        f"{100 * (1 - P['median_ratio_95'][0]):.0f} % against it",
        f"With raw weights it won {paired(Q)})",
        f"than `pre` in {A['post_wins']} of {A['n']} configurations (median ratio "
        f"{A['median_ratio']:.2f})",
        splits.replace("$v$ 7 | 10", "$v$ 7 | 10 of 20", 1)])   # all six


def test_notebook_and_readme_numbers_match_the_search_with_mlps():
    # P11 items 4-5: plots/search_mlp, 30 configurations x 4 arms, drawn as search_configs draws
    record, groups, results = search_record("search_mlp/", 30, 0, None, True)
    h = record["summary"]
    P, S, N = (h[a]["ema"]["all"] for a in ("pre-final", "post", B.NO_LN2))
    pairs = B.search_pairs(groups, results, B.NO_LN2, "ema")   # (log TVD ratio, worse train TVD)
    low = Counter(B.arm(min(g, key=lambda c: results[c]["ema"]["tvd"][2 * c.train_len - 1]))
                  for g in groups)
    sub = {t: h["pre-final"]["ema"][f"train TVD < {t}"] for t in (0.05, 0.1, 0.2)}
    assert_quoted([
        "won " + paired(P, "pre_wins", ".2g", full=True), "won " + paired(S, "pre_wins", ".2g"),
        "won " + paired(N, "pre_wins", ".2g"),
        f"`pre` in {low['pre']}, `pre-final` in {low['pre-final']}, `post` in {low['post']}, "
        f"`pre, no MLP norm` in {low[B.NO_LN2]} of 30",
        f"{record['wall_seconds']:.0f} s of wall time",
        f"`pre` against `pre-final`: below 0.05, {paired(sub[0.05], 'pre_wins')}); " + "; ".join(
            f"below {t}, {sub[t]['pre_wins']} of {sub[t]['n']} ({sub[t]['median_ratio']:.2f})"
            for t in (0.1, 0.2)),
        f"higher in {N['pre_wins']} of 30 configurations with EMA weights "
        f"({h[B.NO_LN2]['raw']['all']['pre_wins']} of 30 with raw weights), by a median "
        f"{100 * (N['median_ratio'] - 1):.0f} %",
        "in 3 the difference is under 2 % and in 8 under 5 %, and in one the arm without the norm "
        f"diverged (training TVD {max(t for _, t in pairs):.3f})"])
    assert [sum(math.exp(x) < c for x, _ in pairs) for c in (1.02, 1.05)] == [3, 8]
    assert N["pre_wins"] == N["n"] == 30
    assert P["sign_p"] > 0.05 < S["sign_p"]   # none detectably best
    p = "{:.0e}".format(N["sign_p"]).replace("e-0", "e-")   # 2e-9
    assert_quoted([f"(`pre` beats `pre-final` in {P['pre_wins']} of 30), but removing the norm "
                   "before `pre`'s MLP raises its TVD in every configuration with EMA weights",
                   f"({N['pre_wins']} "
                   f"of 30 with EMA weights, {h[B.NO_LN2]['raw']['all']['pre_wins']} of 30 raw, "
                   f"median ratio {N['median_ratio']:.2f}; sign test p = {p})"], "README.md")


def test_notebook_tuned_search_numbers_match_plots_search_tuned():
    # Lab notebook, section 5: 24 configurations, each arm at each of 3 rates (every run kept),
    # each arm at its rate with the lowest training-length TVD; the README quotes the endpoint.
    lrs = (0.001, 0.00316, 0.01)
    record, configs, results = search_record("search_tuned/", 24, 1000, lrs)
    P, Q = (record["summary"]["pre-final"][avg]["all"] for avg in ("ema", "raw"))
    best = [B.search_arms(group, results) for group in configs]
    chosen = Counter((arm, c.lr) for b in best for arm, (c, _) in b.items())
    train = lambda c: R.summarize(results[c]["ema"], c.train_len)["tvd_train"]  # noqa: E731
    worse = sum(train(b["post"][0]) > train(b["pre-final"][0]) for b in best)
    at_2l = lambda c: results[c]["ema"]["tvd"][2 * c.train_len - 1]  # noqa: E731
    pairs = lambda lr: [(pf, po) for group in configs for pf in group for po in group  # noqa
                        if pf.lr == po.lr == lr and (pf.norm, po.norm) == ("pre-final", "post")]
    shared = [B.search_stats([(math.log(at_2l(pf) / at_2l(po)), 0) for pf, po in pairs(lr)])
              for lr in lrs]
    best_at_2l = Counter(min((c for c in group if c.norm == "post"), key=at_2l).lr
                         for group in configs)
    splits = [line.strip("| ").split(" | ") for line in B.search_losses(configs, results)[2:]]
    fit = sorted(train(po) / train(pf) for pf, po in pairs(0.001))
    assert_quoted([
        "`python plots/lab.py --search 24 --lrs 0.001,0.00316,0.01 --seed 1000 --out "
        "runs/search_tuned`",
        f"144 runs, {record['wall_seconds'] / 3600:.1f} h (interrupted and resumed with "
        "`--resume`)",
        f"at 0.001 `post` is lower in {shared[0]['post_wins']} of 24 but also fits the training "
        f"lengths worse in {sum(r > 1 for r in fit)} of 24 (median training-TVD ratio "
        f"{fit[11] / 2 + fit[12] / 2:.2f}); at 0.01 it is lower in "
        f"{shared[2]['post_wins']} of 24 (median ratio {shared[2]['median_ratio']:.2f})",
        f"`pre-final` in {P['post_wins']} of 24 (95 % Wilson interval {span(P['win_rate_95'])}); "
        f"sign test $p = {P['sign_p']:.2f}$, Wilcoxon $p = {P['wilcoxon_p']:.2f}$; median ratio "
        f"`pre-final` / `post` {P['median_ratio']:.2f} (95 % bootstrap interval "
        f"{span(P['median_ratio_95'])})",
        f"below in {Q['post_wins']} of 24 (sign test $p = {Q['sign_p']:.2g}$, Wilcoxon $p = "
        f"{Q['wilcoxon_p']:.2g}$, median ratio {Q['median_ratio']:.2f}, interval "
        f"{span(Q['median_ratio_95'])})",
        f"worse in {worse} of 24", f"(`pre-final` 0.001 in {chosen['pre-final', 0.001]} of 24, "
        f"`post` 0.01 in {chosen['post', 0.01]})",
        f"`post` is below `pre-final` at $2L$ in {shared[0]['post_wins']} of 24 at 0.001 "
        f"(median ratio {shared[0]['median_ratio']:.2f}), {shared[1]['post_wins']} of 24 at "
        f"0.00316 ({shared[1]['median_ratio']:.2f}) and {shared[2]['post_wins']} of 24 at 0.01 "
        f"({shared[2]['median_ratio']:.2f}), and `post`'s rate with the lowest TVD at $2L$ is "
        f"0.001 in {best_at_2l[0.001]} of 24",
        ", ".join(f"{SPLITS[name]} {low} | {high}" for name, _, low, high in splits
                  if name != "lr")])   # the rows: v, L / v, heads, lr, batch, steps
    assert chosen["post", 0.01] > max(chosen["post", 0.001], chosen["post", 0.00316])
    assert [row[3] for row in splits if row[0] == "lr"] == ["-"]   # "it splits nothing"


def test_readme_gives_the_number_of_tests():
    # Counted from both test files: each test function, times the values of its parametrizes.
    n = 0
    for name, f in [*vars(T).items(), *globals().items()]:
        if name.startswith("test_") and callable(f):
            n += math.prod(len(m.args[1]) for m in getattr(f, "pytestmark", [])
                           if m.name == "parametrize")
    assert f"`python -m pytest -q` runs {n} tests" in flat("README.md")
