"""
resharpen.py: a minimal, single-file reference for "Post-Norm can Resharpen Attention"
(Zsamboki et al., arXiv 2510.08341).

The Set Complement task: given a set of distinct tokens from a vocabulary of v, predict the
uniform distribution over the tokens that are NOT in it. A tiny transformer with no
positional encoding trained on short prefixes runs at any length, but its attention
spreads over more tokens as the input grows (dispersion) and its predictions blur. A
LayerNorm on the attention output resharpens them; an EMA of the weights averages out
the noise of sampled next tokens. theory.md proves all of this; this file checks it.

    python resharpen.py                          # Pre-Norm, no EMA: watch it degrade
    python resharpen.py --post-norm --ema 0.999  # the paper's remedies
    python resharpen.py --theory                 # theory.md's models, built by hand
    python resharpen.py --compare                # every claim, 3 seeds (about 7 minutes)
    python resharpen.py --suite                  # Dyck and Shuffle languages (about 4.5 minutes)
    python resharpen.py --help                   # every flag, with its default

Reading order: Set Complement task -> formal languages -> model -> EMA -> training ->
evaluation -> figures -> files -> comparison -> language suite -> theory -> command line.
Importing this file runs nothing; tests and notebooks use its pieces.
"""

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# configuration: every default in one place


@dataclass
class Config:
    # task
    task: str = "complement"  # 'complement', or a formal language: 'dyck', 'shuffle'
    vocab: int = 32           # v: tokens are 0 .. v-1 (set to 2k + 1 for a language)
    train_len: int = 12       # train on prefixes of length s = 1 .. train_len
    brackets: int = 2         # k, for the languages: bracket pairs
    max_depth: int = 4        # D, for Dyck-(k, D): the deepest nesting allowed
    targets: str = "sampled"  # 'sampled': one next token per position; 'exact': the whole target
    # model
    norm: str = "pre"         # where the LayerNorm sits: see NORMS below
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 64
    mlp: bool = False         # attention-only by default, like the paper's minimal model
    bos: bool = False         # prepend a beginning-of-sequence token (a possible attention sink)
    dropout: float = 0.0
    # optimization
    steps: int = 4000
    batch_size: int = 256
    lr: float = 3e-3          # constant by default: the regime where gradient noise shows
    lr_schedule: str = "constant"  # or 'cosine': decay to zero over the run
    ema: float = 0.0          # decay of the weight EMA; 0 = off
    bema: bool = False        # bias-corrected EMA (BEMA) instead of the plain EMA
    seed: int = 0
    device: str = "auto"

    def __post_init__(self):
        if self.task != "complement":   # k opens, k closes, END
            self.vocab = 2 * self.brackets + 1


NORMS = {
    "pre": "x + Attn(LN(x)), no final norm: logits read the raw residual stream",
    "pre-final": "x + Attn(LN(x)), then LN before the unembedding (GPT-2)",
    "post": "x + LN(Attn(x)): the norm on the attention output (resharpens; --post-norm)",
    "post-residual": "LN(x + Attn(x)): Vaswani et al. 2017, the norm after the residual sum",
}
EVAL_SEED = 1234    # the evaluation permutations never change with --seed or the model
EVAL_PERMS = 1000   # evaluation sample size: permutations of the whole vocabulary

# -----------------------------------------------------------------------------
# the Set Complement task (theory.md, section 1)


def sample_permutations(n, vocab, generator=None):
    """n random orderings of the vocabulary, (n, vocab). Read left to right, each next token
    is a uniform sample from the tokens not seen yet: a sample of the task's target."""
    return torch.argsort(torch.rand(n, vocab, generator=generator), dim=1)


def get_batch(cfg, generator):
    """Inputs x (B, T) and next tokens y (B, T) with T = train_len: position t of x ends
    the prefix of length s = t + 1, and y[:, t] is a sample from that prefix's target."""
    if cfg.task == "complement":
        seq = sample_permutations(cfg.batch_size, cfg.vocab, generator)[:, : cfg.train_len + 1]
    else:
        seq = sample_language(cfg, cfg.batch_size, cfg.train_len + 1, generator)
    return seq[:, :-1], seq[:, 1:]


def exact_target(idx, vocab, dtype=torch.float):
    """p*(prefix) for every prefix of every row: (B, T) -> (B, T, v). Zero on the tokens
    seen so far, uniform on the rest. A prefix must not hold the whole vocabulary."""
    seen = F.one_hot(idx, vocab).cumsum(dim=1).clamp(max=1)  # (B, T, v): 1 if seen by t
    unseen = (1 - seen).to(dtype)
    return unseen / unseen.sum(dim=-1, keepdim=True)

# -----------------------------------------------------------------------------
# formal languages with several legal next tokens: Dyck-(k, D) and Shuffle-k
# Tokens: 0 .. k-1 open brackets, k .. 2k-1 their closes, 2k END. A sequence is a stream of
# strings, each ended by END, after which the next string starts from the empty state; so
# every position has an exact next-token distribution, given by a small automaton.


def language_state(cfg, n):
    """The automaton's state for n rows, before any token."""
    return {"count": torch.zeros(n, cfg.brackets, dtype=torch.long),   # opens - closes, per type
            "stack": torch.zeros(n, cfg.max_depth, dtype=torch.long),  # open types, bottom first
            "depth": torch.zeros(n, dtype=torch.long)}


def language_next(cfg, state, dtype=torch.float):
    """The exact distribution of the next token of every row, (n, 2k + 1).
    dyck (Hewitt et al. 2020): empty stack: each open 1/(2k), END 1/2; full stack (depth D):
      only the matching close; otherwise each open 1/(2k), the matching close 1/2.
    shuffle (Bhattamishra et al. 2020): uniform over every open, every close whose counter
      is above 0, and END when all counters are 0."""
    k, depth = cfg.brackets, state["depth"]
    if cfg.task == "shuffle":
        legal = torch.cat([torch.ones_like(state["count"]), state["count"] > 0,
                           (state["count"] == 0).all(1, keepdim=True)], dim=1).to(dtype)
        return legal / legal.sum(1, keepdim=True)
    empty, full = depth == 0, depth == cfg.max_depth
    top = state["stack"].gather(1, (depth - 1).clamp(min=0)[:, None])      # (n, 1)
    p = torch.zeros(len(depth), 2 * k + 1, dtype=dtype)
    p[:, :k] = torch.where(full, 0.0, 1 / (2 * k)).to(dtype)[:, None]
    p[:, 2 * k] = torch.where(empty, 0.5, 0.0).to(dtype)
    close = torch.where(empty, 0.0, torch.where(full, 1.0, 0.5)).to(dtype)
    return p.scatter(1, k + top, close[:, None])   # an empty stack's 'close' writes a 0


def language_step(cfg, state, tok):
    """Advance every row's automaton by one token (n,)."""
    k = cfg.brackets
    sign = (tok < k).long() - ((tok >= k) & (tok < 2 * k)).long()   # +1 open, -1 close, 0 END
    kind = tok % k
    slot = state["depth"].clamp(0, cfg.max_depth - 1)[:, None]
    pushed = torch.where(sign > 0, kind, state["stack"].gather(1, slot)[:, 0])
    state["stack"].scatter_(1, slot, pushed[:, None])
    state["depth"] = (state["depth"] + sign).clamp(0, cfg.max_depth)
    state["count"] += F.one_hot(kind, k) * sign[:, None]


def sample_language(cfg, n, T, generator=None):
    """n streams of T tokens, each token drawn from the automaton's distribution."""
    state, tokens = language_state(cfg, n), []
    for _ in range(T):
        tok = torch.multinomial(language_next(cfg, state), 1, generator=generator)[:, 0]
        language_step(cfg, state, tok)
        tokens.append(tok)
    return torch.stack(tokens, dim=1)


def target(idx, cfg, dtype=torch.float):
    """The exact next-token distribution after every prefix of every row: (B, T) -> (B, T, v)."""
    if cfg.task == "complement":
        return exact_target(idx, cfg.vocab, dtype)
    state, out = language_state(cfg, idx.shape[0]), []
    for t in range(idx.shape[1]):
        language_step(cfg, state, idx[:, t].cpu())
        out.append(language_next(cfg, state, dtype))
    return torch.stack(out, dim=1).to(idx.device)


def task_name(cfg):
    return {"complement": "Set Complement", "dyck": f"Dyck-({cfg.brackets}, {cfg.max_depth})",
            "shuffle": f"Shuffle-{cfg.brackets}"}[cfg.task]


def eval_inputs(cfg, n):
    """The fixed evaluation inputs: whole permutations (lengths 1 .. v-1) for the Set
    Complement task, streams of 4 x train_len tokens for a language."""
    g = torch.Generator().manual_seed(EVAL_SEED)
    if cfg.task == "complement":
        return sample_permutations(n, cfg.vocab, g)[:, : cfg.vocab - 1]
    return sample_language(cfg, n, 4 * cfg.train_len, g)

# -----------------------------------------------------------------------------
# the model: a tiny decoder-only transformer with no positional encoding


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out so that its weights can be read."""

    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # W_Q, W_K, W_V
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)      # W_O
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)    # (B, nh, T, T)
        # Causal mask only, no positions: the last token sees its prefix as a set, which
        # is why one model runs at every length (theory.md, section 1).
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = self.drop(att) @ v                             # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)   # (B, T, C)
        return self.c_proj(y), att


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block. cfg.norm says where its LayerNorms sit (theory.md, section 5):
        pre, pre-final   x = x + Attn(LN(x));   x = x + MLP(LN(x))
        post             x = x + LN(Attn(x));   x = x + LN(MLP(x))
        post-residual    x = LN(x + Attn(x));   x = LN(x + MLP(x))
    """

    def __init__(self, cfg):
        super().__init__()
        self.norm = cfg.norm
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd) if cfg.mlp else None
        self.mlp = MLP(cfg) if cfg.mlp else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        if self.norm in ("pre", "pre-final"):
            a, att = self.attn(self.ln_1(x))
            x = x + self.drop(a)
            if self.mlp:
                x = x + self.mlp(self.ln_2(x))
        elif self.norm == "post":
            # The norm rescales the attention average back to unit size however many
            # tokens it averaged: this is what resharpens (theory.md, section 5).
            a, att = self.attn(x)
            x = x + self.ln_1(self.drop(a))
            if self.mlp:
                x = x + self.ln_2(self.mlp(x))
        else:  # post-residual
            a, att = self.attn(x)
            x = self.ln_1(x + self.drop(a))
            if self.mlp:
                x = self.ln_2(x + self.mlp(x))
        return x, att


class Transformer(nn.Module):
    """Token embedding -> blocks -> (final LN for 'pre-final') -> unembedding. No positions."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab + cfg.bos, cfg.n_embd)   # E; row v is BOS, if any
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd) if cfg.norm == "pre-final" else nn.Identity()
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)  # U
        for p in self.parameters():   # GPT-2's init; LayerNorms keep weight 1, bias 0
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx, return_attn=False):
        """idx (B, T) LongTensor -> logits (B, T, v); with return_attn, also the attention
        weights of every layer, a list of (B, n_head, T, T) (T + 1 keys with cfg.bos)."""
        if self.cfg.bos:  # token v at position 0; its own output predicts nothing and is cut
            idx = torch.cat([torch.full_like(idx[:, :1], self.cfg.vocab), idx], dim=1)
        x = self.wte(idx)  # (B, T, C)
        atts = []
        for block in self.blocks:
            x, att = block(x)
            atts.append(att)
        logits = self.lm_head(self.ln_f(x))
        if self.cfg.bos:
            logits, atts = logits[:, 1:], [a[:, :, 1:] for a in atts]
        return (logits, atts) if return_attn else logits

# -----------------------------------------------------------------------------
# EMA of the weights (theory.md, section 6)


class EMA:
    """A shadow copy of the parameters, averaged after every optimizer step:
        avg_t = (1 - beta_t) * avg_{t-1} + beta_t * theta_t,   beta_t = (1 - d) / (1 - d**t)
    This beta_t is Adam's bias correction written as a weight: avg_t is exactly the
    average of theta_1 .. theta_t with weights proportional to d**(t - k), so the random
    initialization never enters it and a short run is not dominated by the start."""

    def __init__(self, model, decay):
        self.decay = decay
        self.t = 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def beta(self, t):
        return (1 - self.decay) / (1 - self.decay**t)

    @torch.no_grad()
    def update(self, model):
        self.t += 1
        beta = self.beta(self.t)
        for s, p in zip(self.shadow, model.parameters()):
            s.lerp_(p, beta)  # s + beta * (p - s)

    def averaged(self):
        """The weights to evaluate."""
        return self.shadow

    @torch.no_grad()
    def copy_to(self, model):
        for a, p in zip(self.averaged(), model.parameters()):
            p.copy_(a)


class BEMA(EMA):
    """Bias-corrected EMA (Block & Zhang 2025, "EMA Without the Lag"), with their defaults:
        beta_t  = (rho + gamma t)^-kappa            the weight of the new iterate
        alpha_t = (rho + gamma t)^-eta              the strength of the correction
        ema_t   = (1 - beta_t) ema_{t-1} + beta_t theta_t,   ema_0 = theta_0
        bema_t  = alpha_t (theta_t - theta_0) + ema_t
    theta_0 is the initialization (no burn-in). The correction adds back a fraction of
    the drift since theta_0, which cancels the lag an average has behind moving weights.
    It is computed when asked for, from the model's current weights theta_t."""

    def __init__(self, model, kappa=0.5, eta=0.2, rho=10.0, gamma=1.0, correct=True):
        super().__init__(model, decay=None)
        self.kappa, self.eta, self.rho, self.gamma, self.correct = kappa, eta, rho, gamma, correct
        self.theta0 = [p.detach().clone() for p in model.parameters()]
        self.params = list(model.parameters())   # live: theta_t after the t-th update

    def beta(self, t):
        return (self.rho + self.gamma * t) ** -self.kappa

    def alpha(self, t):
        return (self.rho + self.gamma * t) ** -self.eta if self.correct else 0.0

    @torch.no_grad()
    def averaged(self):
        a = self.alpha(self.t)
        return [s + a * (p - p0) for s, p, p0 in zip(self.shadow, self.params, self.theta0)]


def make_averager(model, cfg):
    """The weight average cfg asks for: BEMA, a plain EMA, or none."""
    if cfg.bema:
        return BEMA(model)
    return EMA(model, cfg.ema) if cfg.ema > 0 else None


def average_name(cfg):
    return "BEMA" if cfg.bema else f"EMA {cfg.ema}" if cfg.ema > 0 else "none"


def averaged_copy(model, averager):
    """A copy of the model holding the averaged weights; the model keeps the raw ones."""
    model = copy.deepcopy(model)
    averager.copy_to(model)
    return model

# -----------------------------------------------------------------------------
# training


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def loss_fn(logits, x, y, cfg):
    """Cross-entropy against the sampled next token y, or against the exact target of
    every prefix of x. Both have the same expected gradient; 'exact' has no noise."""
    logp = F.log_softmax(logits, dim=-1)  # (B, T, v)
    if cfg.targets == "exact":
        return -(target(x, cfg) * logp).sum(-1).mean()
    return F.nll_loss(logp.view(-1, cfg.vocab), y.reshape(-1))


def loss_floor(cfg):
    """The lowest possible loss: the target's entropy, averaged over the training positions.
    Set Complement: the mean of log(v - s). A language: estimated on 2000 fixed streams."""
    if cfg.task == "complement":
        return sum(math.log(cfg.vocab - s) for s in range(1, cfg.train_len + 1)) / cfg.train_len
    p = target(eval_inputs(cfg, 2000)[:, : cfg.train_len], cfg, torch.double)
    return -(p * p.clamp_min(1e-30).log()).sum(-1).mean().item()


class NonFiniteLoss(RuntimeError):
    pass


def learning_rate(cfg, step):
    """Constant, or a cosine decay from cfg.lr at step 1 to zero at the last step."""
    if cfg.lr_schedule == "cosine":
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / max(cfg.steps - 1, 1)))
    return cfg.lr


def train(cfg, log=print, averagers=None):
    """Train a model on cfg's task. Returns (model, averagers, losses): the model holds the
    raw (last-step) weights; averagers are the weight averages updated after every step:
    the one cfg asks for, or one per function model -> averager in `averagers`. They never
    feed back into training, so one run gives the numbers with and without them."""
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)                      # the initialization
    gen = torch.Generator().manual_seed(cfg.seed)    # the training data, on the CPU
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if averagers is None:
        averagers = [a for a in [make_averager(model, cfg)] if a]
    else:
        averagers = [make(model) for make in averagers]
    losses, floor = [], loss_floor(cfg)
    t0 = t_last = time.time()
    every = max(1, cfg.steps // 8)
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        x, y = get_batch(cfg, gen)
        x, y = x.to(device), y.to(device)
        loss = loss_fn(model(x), x, y, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for avg in averagers:
            avg.update(model)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise NonFiniteLoss(f"loss became {losses[-1]} at step {step}; try a smaller --lr")
        if step % every == 0 or step == cfg.steps:
            now = time.time()
            rate = every / max(now - t_last, 1e-9) if step % every == 0 else step / (now - t0)
            t_last = now
            recent = sum(losses[-every:]) / len(losses[-every:])
            log(f"step {step:5d}/{cfg.steps} | loss {recent:.4f} (floor {floor:.4f}) "
                f"| {rate:.0f} steps/s | ETA {(cfg.steps - step) / rate:.0f}s")
    return model, averagers, losses

# -----------------------------------------------------------------------------
# length-extrapolation evaluation (theory.md, sections 3-5)


@torch.no_grad()
def evaluate(model, n_perm=EVAL_PERMS):
    """Metrics at every prefix length s = 1 .. v-1 (for a language: every position up to
    4 x train_len), each averaged over n_perm fixed inputs. One forward pass over whole
    permutations gives every length at once."""
    cfg = model.cfg
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = eval_inputs(cfg, n_perm)                      # (N, T), on the CPU
    logits, atts = model(idx.to(device), return_attn=True)   # (N, T, v)
    # The metrics are computed on the CPU in float64 (which MPS lacks): the hand-built
    # models of theory.md reach TVDs of 1e-30.
    logits, atts = logits.detach().cpu().double(), [a.detach().cpu() for a in atts]
    p = target(idx, cfg, torch.double)                  # (N, T, v)
    seen = p == 0          # the seen tokens; for a language, every illegal next token
    logq = F.log_softmax(logits, dim=-1)
    q = logq.exp()
    # Total variation distance to the exact target, written as the total excess of q over
    # p* (equal to half the L1 distance, and exact even when it is as small as 1e-30),
    # and the mass on seen (invalid) tokens.
    tvd = (q - p).clamp_min(0).sum(-1)
    invalid = (q * seen).sum(-1)
    # KL(p* || q): sums only over the unseen tokens, where p* > 0.
    kl = torch.where(seen, 0.0, p * (p.clamp_min(1e-30).log() - logq)).sum(-1)
    # Mean logit of the unseen tokens minus mean logit of the seen ones (theory.md, 3).
    gap = (logits * ~seen).sum(-1) / (~seen).sum(-1) - (logits * seen).sum(-1) / seen.sum(-1)
    # Entropy of the attention row of the last position, averaged over heads and layers;
    # it is at most log s (log(s + 1) with a BOS token), reached by uniform attention.
    att = torch.stack(atts)                             # (L, N, nh, T, T)
    ent = -(att * att.clamp_min(1e-30).log()).sum(-1)   # (L, N, nh, T)
    ent = ent.mean(dim=(0, 1, 2))
    model.train(was_training)
    mean = lambda m: [float(a) for a in m.mean(0)]  # average over the permutations
    return {"length": list(range(1, idx.shape[1] + 1)), "tvd": mean(tvd),
            "invalid_mass": mean(invalid), "kl": mean(kl),
            "attn_entropy": [float(a) for a in ent], "logit_gap": mean(gap)}


def summarize(metrics, train_len):
    """Mean TVD over the training lengths, over the extrapolation lengths, and at the last."""
    tvd = metrics["tvd"]
    return {"tvd_train": sum(tvd[:train_len]) / train_len,
            "tvd_extrap": sum(tvd[train_len:]) / len(tvd[train_len:]),
            "tvd_last": tvd[-1]}


def format_table(metrics, train_len, raw=None):
    """A compact table, one row per selected length."""
    n = len(metrics["length"])
    rows = sorted({1, 2, 4, train_len, train_len + 1, 2 * train_len, n} | set(range(8, n, 8)))
    head = f"{'s':>4} {'TVD':>7} {'invalid':>8} {'KL':>7} {'H(attn)':>8} {'log s':>6} {'gap':>7}"
    head += f" {'TVD raw':>8}" if raw else ""
    lines = [head]
    for s in (r for r in rows if 1 <= r <= n):
        i = s - 1
        line = (f"{s:>4} {metrics['tvd'][i]:7.4f} {metrics['invalid_mass'][i]:8.4f} "
                f"{metrics['kl'][i]:7.4f} {metrics['attn_entropy'][i]:8.3f} "
                f"{math.log(s):6.3f} {metrics['logit_gap'][i]:7.3f}")
        line += f" {raw['tvd'][i]:8.4f}" if raw else ""
        lines.append(line + ("   <- longest training length" if s == train_len else ""))
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# figures (matplotlib's object API with the Agg canvas: no screen, no global state)


def _figure(ncols=1):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5.2 * ncols, 3.8), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _save(fig, path):
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def plot_length(metrics, cfg, out, raw=None):
    """plots/length.png: TVD and invalid mass against length, training lengths shaded."""
    fig, axes = _figure(2)
    s = metrics["length"]
    for ax, key, title in zip(axes, ("tvd", "invalid_mass"),
                              ("TVD to the exact target", "invalid mass (on seen tokens)")):
        ax.axvspan(0.5, cfg.train_len + 0.5, color="0.9", label="training lengths")
        if raw:
            ax.plot(s, raw[key], color="tab:gray", lw=1.2, label="raw weights")
        ax.plot(s, metrics[key], color="tab:blue", lw=2,
                label=average_name(cfg) if raw else "model")
        ax.set(xlabel="prefix length s", title=title, ylim=(0, None), xlim=(0.5, s[-1] + 0.5))
        ax.legend(fontsize=8)
    fig.suptitle(f"norm={cfg.norm}, averaging={average_name(cfg)}, targets={cfg.targets}, "
                 f"seed={cfg.seed}",
                 fontsize=10)
    _save(fig, os.path.join(out, "length.png"))


def plot_attention(metrics, cfg, out):
    """plots/attention.png: entropy of the last position's attention against log s."""
    fig, ax = _figure()
    logs = [math.log(s) for s in metrics["length"]]
    ax.axvspan(0, math.log(cfg.train_len + 0.5), color="0.9", label="training lengths")
    ax.plot(logs, metrics["attn_entropy"], "o-", ms=4, label="model")
    ax.plot(logs, logs, "k--", lw=1, zorder=3, label="log s (uniform attention)")
    ax.set(xlabel="log s", ylabel="attention entropy (nats)", title="attention dispersion")
    ax.legend(fontsize=8)
    _save(fig, os.path.join(out, "attention.png"))


def plot_loss(losses, cfg, out):
    """plots/loss.png: the training loss, smoothed over 50 steps, and its floor."""
    fig, ax = _figure()
    k = min(50, len(losses))
    smooth = [sum(losses[i:i + k]) / k for i in range(len(losses) - k + 1)]
    ax.plot(range(k, len(losses) + 1), smooth, lw=1, label=f"{cfg.targets} loss ({k}-step mean)")
    ax.axhline(loss_floor(cfg), color="k", ls="--", lw=1, label="floor: entropy of the target")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="training loss")
    ax.legend(fontsize=8)
    _save(fig, os.path.join(out, "loss.png"))

# -----------------------------------------------------------------------------
# files: written to a temporary name, then renamed, so a crash never leaves half a file


def write_text(text, path):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_json(obj, path):
    write_text(json.dumps(obj, indent=1), path)


def save_checkpoint(path, model, averager, cfg):
    """Write config, raw and EMA weights to a temporary file, then rename: a crash never
    leaves a half-written checkpoint."""
    ckpt = {"config": asdict(cfg), "model": model.state_dict()}
    if averager:
        ckpt["ema"] = [a.cpu() for a in averager.averaged()]
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(ckpt, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, raw=False, device="cpu"):
    """A ready model in eval mode: the EMA weights if the run had them (unless raw=True)."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    cfg = Config(**ckpt["config"])
    model = Transformer(cfg)
    model.load_state_dict(ckpt["model"])
    if "ema" in ckpt and not raw:
        with torch.no_grad():
            for p, s in zip(model.parameters(), ckpt["ema"]):
                p.copy_(s)
    return model.to(device).eval()

# -----------------------------------------------------------------------------
# the comparison experiment: every claim of the paper, 3 seeds each (README, "Results")

COMPARE_SEEDS = 3
COMPARE_EMA = 0.999
AVERAGES = ("raw", "ema", "bema")
AVERAGE_LABELS = {"raw": "none", "ema": f"EMA {COMPARE_EMA}", "bema": "BEMA"}


def compare_grid(base):
    """Every run of the comparison. Each run trains once and is evaluated with its raw,
    EMA and BEMA weights: the averages never feed back into training, so 'EMA off' is
    exactly the raw weights of the same run."""
    seeds = [base.seed + i for i in range(COMPARE_SEEDS)]
    sampled = dict(targets="sampled", lr_schedule="constant", ema=0.0, bema=False)
    runs = [replace(base, norm=n, seed=s, **sampled) for n in NORMS for s in seeds]
    for targets in ("sampled", "exact"):          # where the noise comes from (post-norm)
        for schedule in ("constant", "cosine"):
            if (targets, schedule) != ("sampled", "constant"):   # that one is above
                runs += [replace(base, norm="post", targets=targets, lr_schedule=schedule,
                                 ema=0.0, bema=False, seed=s) for s in seeds]
    return runs


def compare_one(cfg, threads=None):
    """Train one configuration and evaluate its raw, EMA and BEMA weights."""
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    model, (ema, bema), _ = train(cfg, log=lambda *a: None,
                                  averagers=[lambda m: EMA(m, COMPARE_EMA), BEMA])
    result = {"raw": evaluate(model), "ema": evaluate(averaged_copy(model, ema)),
              "bema": evaluate(averaged_copy(model, bema))}
    return cfg, result, time.time() - t0


def compare_rows(runs):
    """Group finished runs by configuration: {(norm, targets, schedule, average): [metrics]}."""
    rows = {}
    for cfg, result, _ in runs:
        for avg in AVERAGES:
            key = (cfg.norm, cfg.targets, cfg.lr_schedule, avg)
            rows.setdefault(key, []).append(result[avg])
    return rows


def mean_sd(values):
    """'mean ± sample standard deviation', for the tables."""
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / max(len(values) - 1, 1))
    return f"{mean:.3f} ± {sd:.3f}"


def compare_table(rows, train_len, wall, n_runs, workers):
    def line(key):
        sums = [summarize(m, train_len) for m in rows[key]]
        return " | ".join(mean_sd([s[k] for s in sums]) for k in ("tvd_train", "tvd_extrap",
                                                                   "tvd_last"))
    head = "| TVD, training lengths | TVD, extrapolation | TVD at the longest length |"
    sep = "|---" * 5 + "|"
    out = ["### Where the norm sits (sampled targets, constant learning rate)", "",
           "| norm | weight average " + head, sep]
    for norm in NORMS:
        for avg in AVERAGES:
            key = (norm, "sampled", "constant", avg)
            out.append(f"| `{norm}` | {AVERAGE_LABELS[avg]} | {line(key)} |")
    out += ["", "### Where the noise comes from (`post` norm)", "",
            "| targets, schedule | weight average " + head, sep]
    for targets in ("sampled", "exact"):
        for schedule in ("constant", "cosine"):
            for avg in AVERAGES:
                out.append(f"| {targets}, {schedule} | {AVERAGE_LABELS[avg]} | "
                           f"{line(('post', targets, schedule, avg))} |")
    out += ["", "### The laws of theory.md, sections 3 to 5, on the trained models (EMA weights)",
            "",
            "| norm | quantity, over s = 1 .. v-1 | theory says | min | max |", "|---" * 5 + "|"]
    v = len(rows[("pre", "sampled", "constant", "ema")][0]["length"]) + 1
    laws = [("pre", "gap × s", "constant (1/s decay)", lambda s, g: g * s),
            ("post", "gap × sqrt(s (v-s)) / v", "constant (no decay)",
             lambda s, g: g * math.sqrt(s * (v - s)) / v),
            ("pre", "attention entropy − log s", "0 (uniform attention)", None),
            ("post", "attention entropy − log s", "0 (uniform attention)", None)]
    for norm, what, says, law in laws:
        runs = rows[(norm, "sampled", "constant", "ema")]
        if law:
            vals = [law(s, g) for m in runs for s, g in zip(m["length"], m["logit_gap"])]
        else:
            vals = [h - math.log(s) for m in runs for s, h in zip(m["length"], m["attn_entropy"])]
        out.append(f"| `{norm}` | {what} | {says} | {min(vals):.3f} | {max(vals):.3f} |")
    out += ["", f"Mean ± standard deviation over {COMPARE_SEEDS} seeds. {n_runs} training runs, "
            f"{wall:.0f} s wall in {workers} worker process(es)."]
    return "\n".join(out)


def _band(ax, xs, curves, label, color):
    mean = [sum(c) / len(c) for c in zip(*curves)]
    ax.fill_between(xs, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                    color=color, alpha=0.2, lw=0)
    ax.plot(xs, mean, color=color, lw=2, label=label)


def plot_compare_norms(rows, cfg, out):
    """compare_norms.png: TVD against length per norm placement, mean and min-max band."""
    fig, axes = _figure(2)
    colors = dict(zip(NORMS, ("tab:red", "tab:orange", "tab:blue", "tab:purple")))
    for ax, avg in zip(axes, ("raw", "ema")):
        ax.axvspan(0.5, cfg.train_len + 0.5, color="0.9", label="training lengths")
        for norm in NORMS:
            curves = [m["tvd"] for m in rows[(norm, "sampled", "constant", avg)]]
            _band(ax, list(range(1, cfg.vocab)), curves, f"{norm}: {NORMS[norm].split(':')[0]}",
                  colors[norm])
        ax.set(xlabel="prefix length s", ylabel="TVD to the exact target", ylim=(0, 1),
               xlim=(0.5, cfg.vocab - 0.5), title=f"weight average: {AVERAGE_LABELS[avg]}")
        ax.legend(fontsize=7, loc="upper left")
    _save(fig, os.path.join(out, "compare_norms.png"))


def plot_compare_dispersion(rows, cfg, out):
    """compare_dispersion.png: attention entropy against log s, and the logit gap against s,
    for Pre-Norm and Post-Norm (EMA weights)."""
    fig, (ax1, ax2) = _figure(2)
    s = list(range(1, cfg.vocab))
    logs = [math.log(x) for x in s]
    ax1.plot(logs, logs, "k--", lw=1, zorder=3, label="log s: uniform attention")
    for norm, color in (("pre", "tab:red"), ("post", "tab:blue")):
        runs = rows[(norm, "sampled", "constant", "ema")]
        _band(ax1, logs, [m["attn_entropy"] for m in runs], norm, color)
        _band(ax2, s, [m["logit_gap"] for m in runs], norm, color)
        # theory.md's laws, scaled to the model at the longest training length: beyond it
        # they are predictions. Pre: gap ~ 1/s. Post: gap ~ v / sqrt(s (v - s)).
        L, v = cfg.train_len, cfg.vocab
        at_L = sum(m["logit_gap"][L - 1] for m in runs) / len(runs)
        law = [at_L * L / x if norm == "pre" else
               at_L * math.sqrt(L * (v - L) / (x * (v - x))) for x in s]
        ax2.plot(s, law, ":", color="k", lw=1.2,
                 label="theory, matched at s = train_len" if norm == "post" else None)
    ax1.axvspan(0, math.log(cfg.train_len + 0.5), color="0.9")
    ax2.axvspan(0.5, cfg.train_len + 0.5, color="0.9", label="training lengths")
    ax1.set(xlabel="log s", ylabel="attention entropy, last position (nats)",
            title="attention disperses over the whole prefix")
    ax2.set(xlabel="prefix length s", ylabel="mean logit: unseen minus seen",
            title="logit gap (theory.md, sections 3 and 5)", ylim=(0, None))
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    _save(fig, os.path.join(out, "compare_dispersion.png"))


def plot_compare_noise(rows, cfg, out):
    """compare_noise.png: post-norm TVD per targets/schedule, per weight average."""
    fig, axes = _figure(2)
    groups = [(t, sch) for t in ("sampled", "exact") for sch in ("constant", "cosine")]
    width = 0.27
    for ax, key, title in zip(axes, ("tvd_train", "tvd_extrap"),
                              ("training lengths", "extrapolation lengths")):
        for j, (avg, color) in enumerate(zip(AVERAGES, ("0.6", "tab:blue", "tab:green"))):
            vals = [[summarize(m, cfg.train_len)[key] for m in rows[("post", *g, avg)]]
                    for g in groups]
            mean = [sum(v) / len(v) for v in vals]
            err = [[m - min(v) for m, v in zip(mean, vals)],
                   [max(v) - m for m, v in zip(mean, vals)]]
            xs = [i + (j - 1) * width for i in range(len(groups))]
            ax.bar(xs, mean, width, yerr=err, color=color, label=AVERAGE_LABELS[avg], capsize=2)
        ax.set_xticks(range(len(groups)), [f"{t}\n{sch}" for t, sch in groups], fontsize=8)
        ax.set(ylabel="mean TVD", title=f"post-norm, {title}")
        ax.legend(fontsize=8)
    _save(fig, os.path.join(out, "compare_noise.png"))


def run_grid(runs, device):
    """Train and evaluate every run: on every CPU core at once (one thread each), or one
    at a time on a GPU, with a progress line per run. Returns (results, wall, workers)."""
    workers = min(os.cpu_count() or 1, len(runs)) if device == "cpu" else 1
    print(f"{len(runs)} training runs on {device}, {workers} at a time")
    t0, done = time.time(), []
    if workers > 1:
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(workers)
        results = pool.imap_unordered(_compare_one_thread, runs)
    else:
        pool, results = None, map(compare_one, runs)
    try:
        for cfg, result, seconds in results:
            done.append((cfg, result, seconds))
            s = {a: summarize(result[a], cfg.train_len)["tvd_extrap"] for a in AVERAGES}
            print(f"[{len(done):2d}/{len(runs)}] {task_name(cfg):13s} {cfg.norm:13s} "
                  f"{cfg.targets:7s} {cfg.lr_schedule:8s} seed {cfg.seed} | extrapolation TVD "
                  f"raw {s['raw']:.3f} ema {s['ema']:.3f} bema {s['bema']:.3f} | {seconds:.0f}s "
                  f"| ETA {eta(done, len(runs), workers):.0f}s", flush=True)
    finally:
        if pool:
            pool.terminate()
    done.sort(key=lambda d: runs.index(d[0]))   # grid order, whichever finished first
    return done, time.time() - t0, workers


def eta(done, total, workers):
    """Seconds left: the mean run time so far, times the runs left per worker."""
    mean = sum(seconds for _, _, seconds in done) / len(done)
    return mean * math.ceil((total - len(done)) / workers)


def compare(base, out):
    """python resharpen.py --compare: the grid, then compare.md, compare.json, 3 figures."""
    done, wall, workers = run_grid(compare_grid(base), pick_device(base.device))
    rows = compare_rows(done)
    table = compare_table(rows, base.train_len, wall, len(done), workers)
    print("\n" + table)
    write_text(f"Written by `python resharpen.py --compare` (v={base.vocab}, train lengths "
               f"1..{base.train_len}, {base.steps} steps, batch {base.batch_size}, lr {base.lr}"
               f").\n\n{table}\n", os.path.join(out, "compare.md"))
    write_json({"config": asdict(base), "wall_seconds": round(wall, 1),
                "runs": [{"config": asdict(c), **r} for c, r, _ in done]},
               os.path.join(out, "compare.json"))
    plot_compare_norms(rows, base, out)
    plot_compare_dispersion(rows, base, out)
    plot_compare_noise(rows, base, out)
    print(f"wrote {out}/compare.md, compare.json, compare_norms.png, compare_dispersion.png, "
          f"compare_noise.png | {wall:.0f}s")

# -----------------------------------------------------------------------------
# the formal-language suite: do the remedies carry over? (README, "Formal languages")

SUITE_LANGUAGES = (dict(task="dyck", brackets=2, max_depth=4), dict(task="shuffle", brackets=2))
# Counting and matching brackets need more than a bag of tokens: two layers (the second
# reads what the first computed at every position), an MLP to threshold counts, and a
# BOS token, whose share of uniform attention, 1 / (t + 1), tells the model how long
# its prefix is (theory.md, section 8). Trained on lengths 1..16, tested to 64.
SUITE_MODEL = dict(train_len=16, n_layer=2, n_head=1, n_embd=32, mlp=True, bos=True,
                   dropout=0.0, steps=3000, batch_size=128, lr=1e-3, lr_schedule="constant",
                   targets="sampled", ema=0.0, bema=False)


def suite_grid(base, **overrides):
    """Every language x {pre, post} x 3 seeds, with SUITE_MODEL's settings."""
    seeds = [base.seed + i for i in range(COMPARE_SEEDS)]
    settings = {**SUITE_MODEL, **overrides}
    return [replace(base, **settings, **lang, norm=norm, seed=s)
            for lang in SUITE_LANGUAGES for norm in ("pre", "post") for s in seeds]


def suite_table(done, wall, workers):
    head = ("| language | norm | weight average | TVD, training lengths | TVD, extrapolation "
            "| TVD at the longest length | invalid mass, extrapolation |")
    out, L = [head, "|---" * 7 + "|"], done[0][0].train_len
    for lang in SUITE_LANGUAGES:
        for norm in ("pre", "post"):
            runs = [r for c, r, _ in done if c.task == lang["task"] and c.norm == norm]
            name = task_name(Config(**lang))
            for avg in ("raw", "ema"):
                ms = [r[avg] for r in runs]
                sums = [summarize(m, L) for m in ms]
                inv = [sum(m["invalid_mass"][L:]) / len(m["invalid_mass"][L:]) for m in ms]
                out.append(f"| {name} | `{norm}` | {AVERAGE_LABELS[avg]} | "
                           f"{mean_sd([s['tvd_train'] for s in sums])} | "
                           f"{mean_sd([s['tvd_extrap'] for s in sums])} | "
                           f"{mean_sd([s['tvd_last'] for s in sums])} | {mean_sd(inv)} |")
    out += ["", f"Mean ± standard deviation over {COMPARE_SEEDS} seeds. {len(done)} training "
            f"runs, {wall:.0f} s wall in {workers} worker process(es)."]
    return "\n".join(out)


def plot_suite(done, out):
    """suite.png: TVD against position per language, Pre-Norm and Post-Norm, raw and EMA."""
    fig, axes = _figure(len(SUITE_LANGUAGES))
    for ax, lang in zip(axes, SUITE_LANGUAGES):
        cfg = next(c for c, _, _ in done if c.task == lang["task"])
        ax.axvspan(0.5, cfg.train_len + 0.5, color="0.9", label="training lengths")
        for norm, color in (("pre", "tab:red"), ("post", "tab:blue")):
            runs = [r for c, r, _ in done if c.task == lang["task"] and c.norm == norm]
            xs = runs[0]["raw"]["length"]
            ax.plot(xs, [sum(c) / len(c) for c in zip(*[r["raw"]["tvd"] for r in runs])],
                    "--", color=color, lw=1, label=f"{norm}, raw weights")
            _band(ax, xs, [r["ema"]["tvd"] for r in runs], f"{norm}, EMA {COMPARE_EMA}", color)
        ax.set(xlabel="position", ylabel="TVD to the exact next-token distribution",
               title=task_name(cfg), ylim=(0, None))
        ax.legend(fontsize=7)
    _save(fig, os.path.join(out, "suite.png"))


def suite(base, out, **overrides):
    """python resharpen.py --suite: the languages, then suite.md, suite.json, suite.png."""
    done, wall, workers = run_grid(suite_grid(base, **overrides), pick_device(base.device))
    table = suite_table(done, wall, workers)
    print("\n" + table)
    settings = ", ".join(f"{k} {v}" for k, v in {**SUITE_MODEL, **overrides}.items())
    write_text(f"Written by `python resharpen.py --suite` ({settings}).\n\n{table}\n",
               os.path.join(out, "suite.md"))
    write_json({"wall_seconds": round(wall, 1),
                "runs": [{"config": asdict(c), **r} for c, r, _ in done]},
               os.path.join(out, "suite.json"))
    plot_suite(done, out)
    print(f"wrote {out}/suite.md, suite.json, suite.png | {wall:.0f}s")


def _compare_one_thread(cfg):
    return compare_one(cfg, threads=1)


# -----------------------------------------------------------------------------
# theory: the constructions of theory.md, built by hand in the script's own model

HAND_BUILT_NORMS = ("pre", "post", "post-residual")


def hand_built(vocab, norm, gamma=1.0):
    """The construction of theory.md, sections 3 and 5, in the Transformer class that trains:
    one layer, one head, n_embd = 2v, no MLP, and
      W_Q = W_K = 0          every score is 0, so attention is uniform over the prefix
      E[x] = e_(v+x)         token x sits in the second half of the features
      W_V W_O                writes the centred one-hot e_x - 1/v into the first half
      U[j] = -gamma e_j      logit j reads feature j, so seen tokens are pushed down
    The readout never sees the second half, so B = E U = 0: only the displacement acts."""
    v, n = vocab, 2 * vocab
    # float64 throughout, so that TVDs far below float32's 1e-7 are computed exactly
    model = Transformer(Config(vocab=v, n_embd=n, n_head=1, n_layer=1, norm=norm)).double()
    attn = model.blocks[0].attn
    eye = lambda k: torch.eye(k, dtype=torch.double)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.blocks[0].ln_1.weight.fill_(1.0)
        model.wte.weight[:, v:] = eye(v)
        attn.c_attn.weight[2 * n:3 * n][:v, v:] = eye(v) - 1.0 / v   # W_V
        attn.c_proj.weight.copy_(eye(n))                              # W_O
        model.lm_head.weight[:, :v] = -gamma * eye(v)
    return model.eval()


def predicted_margin(vocab, norm, s, gamma=1.0, eps=1e-5):
    """theory.md, sections 3 and 5: logit of an unseen token minus logit of a seen one, at
    length s, for hand_built(vocab, norm, gamma). The attention average of the values is
    h = 1_t / s - 1/v (1 on the seen tokens), whose seen-unseen difference is 1/s; each
    LayerNorm divides it by the standard deviation of what that norm sees (eps: LN's)."""
    n = 2 * vocab
    var = {"pre": (n - 1) / n**2,                                  # one token: e_(v+x)
           "post": (1 / s - 1 / vocab) / n,                        # only h: shrinks with s
           "post-residual": (1 + 1 / s - 1 / vocab) / n - 1 / n**2,  # token + h
           }[norm]
    return gamma / (s * math.sqrt(var + eps))


def predicted_tvd(vocab, s, margin):
    """theory.md, section 3: with balanced logits the TVD equals the invalid mass,
    s e^-m / (s e^-m + v - s)."""
    return s / (s + (vocab - s) * math.exp(margin))


def fit_lengths_1_2(vocab, n_embd, head_dim, steps=1500, seed=0):
    """theory.md, section 2: fit the minimal model f(t) = B[t_s] + mean_i D[t_i] (uniform
    attention, no norm), with B = E U and D = E W_V W_O U of the given widths, to balanced
    logits at lengths 1 and 2: -2 e_x for (x), -(e_x + e_y) for (x, y), each up to a
    constant. Returns the root-mean-square residual of the fit (Adam, cosine decay)."""
    g = torch.Generator().manual_seed(seed)
    v, n, h = vocab, n_embd, head_dim
    init = lambda *shape: (0.3 * torch.randn(*shape, generator=g)).requires_grad_()
    E, W_V, W_O, U = init(v, n), init(n, h), init(h, n), init(n, v)
    eye = torch.eye(v)
    x, y = torch.tensor([(x, y) for x in range(v) for y in range(v) if x != y]).T
    opt = torch.optim.Adam([E, W_V, W_O, U], lr=0.02)
    center = lambda f: f - f.mean(-1, keepdim=True)   # logits count only up to a constant
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 0.01 * (1 + math.cos(math.pi * step / steps))
        B, D = E @ U, E @ W_V @ W_O @ U
        length_1 = center(B + D + 2 * eye)                              # input (x)
        length_2 = center(B[y] + (D[x] + D[y]) / 2 + eye[x] + eye[y])   # input (x, y)
        loss = torch.cat([length_1, length_2]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item() ** 0.5


def theory(vocab, train_len, out):
    """python resharpen.py --theory: the hand-built models against their formulas, each
    scaled so that its margin at the longest training length is 6; writes theory.png."""
    rows = {}
    for norm in HAND_BUILT_NORMS:
        gamma = 6.0 / predicted_margin(vocab, norm, train_len)
        m = evaluate(hand_built(vocab, norm, gamma), n_perm=200)
        pred_m = [predicted_margin(vocab, norm, s, gamma) for s in m["length"]]
        pred_tvd = [predicted_tvd(vocab, s, pm) for s, pm in zip(m["length"], pred_m)]
        rows[norm] = (m, pred_m, pred_tvd)
    print(f"hand-built models, v={vocab}, each scaled to margin 6 at s={train_len}; "
          "'model' is evaluate() on the script's own Transformer, in float64\n(TVDs below "
          "about 1e-15 are float64 rounding, not the model)")
    for norm, (m, pred_m, pred_tvd) in rows.items():
        print(f"\n{norm}: {NORMS[norm]}\n{'s':>4} {'margin: formula':>16} {'model':>10} "
              f"{'TVD: formula':>14} {'model':>10}")
        for s in sorted({1, 2, 4, train_len, 2 * train_len, vocab - 1} & set(m["length"])):
            i = s - 1
            print(f"{s:>4} {pred_m[i]:16.5f} {m['logit_gap'][i]:10.5f} {pred_tvd[i]:14.3e} "
                  f"{m['tvd'][i]:10.3e}")
    fig, (ax1, ax2) = _figure(2)
    colors = {"pre": "tab:red", "post": "tab:blue", "post-residual": "tab:purple"}
    for norm, (m, pred_m, pred_tvd) in rows.items():
        c = colors[norm]
        ax1.plot(m["length"], pred_m, color=c, lw=1.5, label=f"{norm}: formula")
        ax1.plot(m["length"], m["logit_gap"], "o", color=c, ms=3, label=f"{norm}: model")
        ax2.semilogy(m["length"], pred_tvd, color=c, lw=1.5, label=f"{norm}: formula")
        ax2.semilogy(m["length"], [max(t, 1e-12) for t in m["tvd"]], "o", color=c, ms=3,
                     label=f"{norm}: model")
    for ax in (ax1, ax2):
        ax.axvspan(0.5, train_len + 0.5, color="0.9")
        ax.set_xlabel("prefix length s")
    ax1.set(ylabel="margin: unseen minus seen logit", title="hand-built margins (theory.md 3, 5)")
    ax2.set(ylabel="TVD (equal to the invalid mass)", title="hand-built TVD", ylim=(1e-9, 1.5))
    ax1.legend(fontsize=7)
    _save(fig, os.path.join(out, "theory.png"))
    print(f"wrote {os.path.join(out, 'theory.png')}")


# -----------------------------------------------------------------------------
# command line


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line naming what is wrong, exit code 2: no usage dump, no traceback."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser():
    d = Config()
    p = Parser(prog="resharpen.py", formatter_class=HelpFormatter,
               description="Train a tiny transformer on short inputs of the Set Complement "
                           "task (or a formal language),\nevaluate it at every length, print "
                           "a table, write figures and metrics.json.",
               epilog="where the LayerNorm sits (--norm):\n" +
               "\n".join(f"  {k:14s} {v}" for k, v in NORMS.items()))
    a = p.add_argument
    a("--task", choices=["complement", "dyck", "shuffle"], default=d.task,
      help="Set Complement, or a formal language: Dyck-(k, D) or Shuffle-k")
    a("--vocab", type=int, default=d.vocab, help="vocabulary size v (at least 3; Set Complement)")
    a("--train-len", type=int, default=d.train_len, help="train on prefix lengths 1 .. this")
    a("--brackets", type=int, default=d.brackets, help="k bracket pairs (dyck, shuffle)")
    a("--max-depth", type=int, default=d.max_depth, help="D, the deepest nesting (dyck)")
    a("--targets", choices=["sampled", "exact"], default=d.targets,
      help="train on one sampled next token per position, or on the exact distribution")
    a("--norm", choices=list(NORMS), default=d.norm, help="where the LayerNorm sits (below)")
    a("--post-norm", action="store_const", dest="norm", const="post", default=argparse.SUPPRESS,
      help="shorthand for --norm post: x + LN(Attn(x))")
    a("--n-layer", type=int, default=d.n_layer, help="number of blocks")
    a("--n-head", type=int, default=d.n_head, help="attention heads per block")
    a("--n-embd", type=int, default=d.n_embd, help="width of the residual stream")
    a("--mlp", action="store_true", help="add an MLP to each block (off: attention only)")
    a("--bos", action="store_true", help="prepend a beginning-of-sequence token to every input")
    a("--dropout", type=float, default=d.dropout, help="dropout probability")
    a("--steps", type=int, default=d.steps, help="optimizer steps")
    a("--batch-size", type=int, default=d.batch_size, help="permutations per step")
    a("--lr", type=float, default=d.lr, help="AdamW learning rate")
    a("--lr-schedule", choices=["constant", "cosine"], default=d.lr_schedule,
      help="constant, or a cosine decay to zero over --steps")
    a("--ema", type=float, default=d.ema, help="EMA decay of the weights, in [0, 1); 0 = off")
    a("--bema", action="store_true",
      help="average with BEMA (bias-corrected EMA, kappa 0.5, eta 0.2, rho 10) instead")
    a("--seed", type=int, default=d.seed, help="seed of the initialization and training data")
    a("--device", choices=["auto", "cpu", "cuda", "mps"], default=d.device,
      help="auto: cuda, then mps, then cpu")
    a("--out", default="plots", help="folder for the figures and metrics.json")
    a("--save", metavar="PATH", help="write a checkpoint (config, raw and EMA weights) here")
    mode = p.add_mutually_exclusive_group()   # instead of one training run:
    a = mode.add_argument
    a("--theory", action="store_true",
      help="build theory.md's models by hand, compare them with the formulas, write theory.png")
    a("--suite", action="store_true",
      help="run the formal-language suite (Dyck-(2, 4), Shuffle-2; pre and post norm; "
           f"{COMPARE_SEEDS} seeds from --seed) with its own model settings (SUITE_MODEL), "
           "and write suite.md and suite.png")
    a("--compare", action="store_true",
      help="run the comparison grid instead (norms x averaging x targets x schedule, "
           f"{COMPARE_SEEDS} seeds from --seed) and write compare.md and compare_*.png")
    return p


def check_args(args, parser):
    """Reject bad input up front, before any training time is spent."""
    bad = parser.error
    if args.vocab < 3:
        bad(f"--vocab must be at least 3, got {args.vocab}")
    if (args.compare or args.theory) and args.task != "complement":
        bad(f"--task {args.task}: --compare and --theory use the Set Complement task only")
    if args.task == "complement" and not 1 <= args.train_len <= args.vocab - 1:
        bad(f"--train-len must be in 1 .. vocab-1 = {args.vocab - 1}, got {args.train_len}")
    if not 0 <= args.ema < 1:
        bad(f"--ema must be in [0, 1), got {args.ema}")
    if not 0 <= args.dropout < 1:
        bad(f"--dropout must be in [0, 1), got {args.dropout}")
    for flag in ("steps", "batch_size", "n_layer", "n_head", "n_embd", "train_len", "brackets",
                 "max_depth"):
        if getattr(args, flag) < 1:
            bad(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        bad(f"--lr must be a positive number, got {args.lr}")
    if args.n_embd % args.n_head:
        bad(f"--n-embd ({args.n_embd}) must be divisible by --n-head ({args.n_head})")
    present = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not present.get(args.device, True):
        allowed = ", ".join(["auto", "cpu"] + [d for d, ok in present.items() if ok])
        bad(f"--device {args.device}: no {args.device.upper()} device here; allowed: {allowed}")
    try:
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        bad(f"--out {args.out}: cannot write there ({e.strerror})")
    if args.save:
        folder = os.path.dirname(os.path.abspath(args.save))
        if os.path.isdir(args.save) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            bad(f"--save {args.save}: cannot write a file there")


def run_one(cfg, out, save=None):
    """The default command: train, evaluate, print the table, write metrics and figures."""
    print(f"{task_name(cfg)}: v={cfg.vocab}, train lengths 1..{cfg.train_len}, "
          f"norm={cfg.norm} [{NORMS[cfg.norm]}], averaging={average_name(cfg)}, "
          f"targets={cfg.targets}, lr={cfg.lr} {cfg.lr_schedule}, seed={cfg.seed}, "
          f"device={pick_device(cfg.device)}")
    t0 = time.time()
    model, averagers, losses = train(cfg)
    train_time = time.time() - t0
    raw = evaluate(model)
    if averagers:
        metrics = evaluate(averaged_copy(model, averagers[0]))
    else:
        metrics, raw = raw, None
    print(f"\nevaluated on {EVAL_PERMS} fixed permutations" +
          (f" with the {average_name(cfg)} weights (raw weights in the last column)"
           if raw else ""))
    print(format_table(metrics, cfg.train_len, raw))
    summary = summarize(metrics, cfg.train_len)
    line = (f"\nmean TVD: training lengths {summary['tvd_train']:.4f} | extrapolation "
            f"{cfg.train_len + 1}..{len(metrics['length'])} {summary['tvd_extrap']:.4f}")
    if raw:
        r = summarize(raw, cfg.train_len)
        line += f"   (raw weights: {r['tvd_train']:.4f} | {r['tvd_extrap']:.4f})"
    print(line)

    result = {"config": asdict(cfg), **metrics, "summary": summary,
              "train_seconds": round(train_time, 2)}
    if raw:
        result["raw"] = {**raw, "summary": summarize(raw, cfg.train_len)}
    write_json(result, os.path.join(out, "metrics.json"))
    plot_length(metrics, cfg, out, raw)
    plot_attention(metrics, cfg, out)
    plot_loss(losses, cfg, out)
    written = [os.path.join(out, f) for f in ("metrics.json", "length.png", "attention.png",
                                              "loss.png")]
    if save:
        save_checkpoint(save, model, averagers[0] if averagers else None, cfg)
        written.append(save)
    print(f"wrote {', '.join(written)} | {time.time() - t0:.1f}s")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    cfg = Config(**{k: getattr(args, k) for k in Config.__dataclass_fields__})
    try:
        if args.theory:
            theory(cfg.vocab, cfg.train_len, args.out)
        elif args.compare:
            compare(cfg, args.out)
        elif args.suite:
            suite(cfg, args.out)
        else:
            run_one(cfg, args.out, args.save)
    except NonFiniteLoss as e:
        print(f"resharpen.py: stopped: {e}. Nothing was written.", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
