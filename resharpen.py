"""resharpen.py: "Post-Norm can Resharpen Attention" (Zsamboki et al., arXiv 2510.08341).
Predict the uniform distribution over the vocabulary tokens NOT in the input. A transformer
with no positions runs at any length, but its attention spreads as the input grows and its
prediction blurs; a LayerNorm on the attention output resharpens it. Part 1 (to line 400) is
the idea, top to bottom: config -> task -> model -> EMA -> training -> evaluation -> figure ->
theory.md's construction by hand. Part 2 reproduces the experiments (skip it at first); it
plugs in through a task object, an attention class (ATTENTIONS) and weight averagers.
    python resharpen.py --post-norm --ema 0.999   # the remedy, about 30 s on a laptop CPU
    python resharpen.py --help                    # every command and flag
"""

import copy
import math
import os
import sys
import time
from dataclasses import dataclass

if __name__ == "__main__":   # run as a command; before torch loads (README, "Threads"):
    import signal   # a signal while the libraries load: one line, no traceback
    for _sig in {signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGINT)}:
        signal.signal(_sig, lambda n, f: (sys.stderr.write(
            "resharpen.py: interrupted while starting; nothing was written\n"), os._exit(128 + n)))
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")   # idle threads soon sleep: runs share cores

import torch
import torch.nn as nn
import torch.nn.functional as F

# ======================================== Part 1: the paper on Set Complement (every default here)


@dataclass
class Config:
    task: str = "complement"  # or a formal language of Part 2: 'dyck', 'shuffle'
    vocab: int = 32           # v: tokens are 0 .. v-1
    train_len: int = 12       # train on prefixes of length s = 1 .. train_len
    targets: str = "sampled"  # 'sampled': one next token per position; 'exact': the target
    norm: str = "pre"         # where the LayerNorm sits: see NORMS
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 64
    mlp: bool = False         # attention only by default, like the paper's minimal model
    bos: bool = False         # prepend a beginning-of-sequence token (a possible sink)
    dropout: float = 0.0      # on the attention weights and on each block's outputs
    steps: int = 4000
    batch_size: int = 256
    lr: float = 3e-3          # constant by default: the regime where gradient noise shows
    lr_schedule: str = "constant"  # or 'cosine': decay to zero over the run
    ema: float = 0.0          # decay of the weight EMA; 0 = off
    seed: int = 0
    device: str = "auto"
    bema: bool = False        # Part 2: average with BEMA instead of the EMA
    brackets: int = 2         # Part 2: k, for the formal languages
    max_depth: int = 4        # Part 2: D, for Dyck-(k, D)
    attn_scale: str = "none"  # a key of ATTENTIONS; Part 2 adds 'logn' (log-length scaling)


NORMS = {
    "pre": "x + Attn(LN(x)), no final norm: logits read the raw residual stream",
    "pre-final": "x + Attn(LN(x)), then LN before the unembedding (GPT-2)",
    "post": "x + LN(Attn(x)): the norm on the attention output (resharpens; --post-norm)",
    "post-residual": "LN(x + Attn(x)): Vaswani et al. 2017, the norm after the residual sum",
}
EVAL_SEED = 1234    # the evaluation inputs never change with --seed or the model
EVAL_PERMS = 1000   # evaluation sample size
EVAL_CHUNK = 2**22  # evaluate about this many numbers at a time, so memory stays bounded


# ----------------------------------------------------------- the task (theory.md, section 1)
class SetComplement:
    """The task as an object with four methods. Part 2's formal languages have the same
    four, so training and evaluation never ask which task they run."""
    name = "Set Complement"

    def __init__(self, cfg):
        self.vocab, self.train_len = cfg.vocab, cfg.train_len

    def sample(self, n, T, generator=None):
        """n random orderings, cut to T tokens: each next token samples its prefix's target."""
        return torch.argsort(torch.rand(n, self.vocab, generator=generator), dim=1)[:, :T]

    def target(self, idx, dtype=torch.float):
        """p*(prefix) of every prefix, (B, T) -> (B, T, v): 0 on seen tokens, else uniform."""
        seen = F.one_hot(idx, self.vocab).cumsum(dim=1).clamp(max=1)  # (B, T, v)
        unseen = (1 - seen).to(dtype)
        return unseen / unseen.sum(dim=-1, keepdim=True)

    def eval_inputs(self, n):
        """The fixed evaluation inputs: whole permutations, so every length 1 .. v-1."""
        return self.sample(n, self.vocab - 1, torch.Generator().manual_seed(EVAL_SEED))

    def loss_floor(self):
        """The lowest possible loss: the target's entropy log(v - s), averaged over s."""
        return sum(math.log(self.vocab - s) for s in range(1, self.train_len + 1)) / self.train_len


# ---------------------------------- the model: a tiny transformer with no positional encoding
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out so that its weights can be read."""

    def __init__(self, cfg):
        super().__init__()
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
        att = self.scores(q, k)                            # (B, nh, T, T)
        # Causal mask, no positions: the last token sees its prefix as a set (theory.md, 1).
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = self.drop(att) @ v                             # (B, nh, T, hs): the average
        y = y.transpose(1, 2).contiguous().view(B, T, C)   # (B, T, C)
        return self.c_proj(y), att

    def scores(self, q, k):   # q k^T / sqrt(head size); Part 2's LogLengthAttention rescales them
        return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


ATTENTIONS = {"none": CausalSelfAttention}   # Part 2 adds 'logn'


class Block(nn.Module):
    """One transformer block. cfg.norm says where its LayerNorms sit (theory.md, section 4):
        pre, pre-final   x = x + Attn(LN(x));   x = x + MLP(LN(x))
        post             x = x + LN(Attn(x));   x = x + LN(MLP(x))
        post-residual    x = LN(x + Attn(x));   x = LN(x + MLP(x))
    Dropout (cfg.dropout) acts on the attention weights and on Attn's and MLP's outputs."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = cfg.norm
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = ATTENTIONS[cfg.attn_scale](cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd) if cfg.mlp else None
        C = cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C, bias=False), nn.GELU(),
                                 nn.Linear(4 * C, C, bias=False)) if cfg.mlp else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """Returns the new residual stream and the attention weights, (B, n_head, T, T)."""
        if self.norm in ("pre", "pre-final"):
            a, att = self.attn(self.ln_1(x))
            x = x + self.drop(a)
            if self.mlp:
                x = x + self.drop(self.mlp(self.ln_2(x)))
        elif self.norm == "post":
            # The norm rescales the attention average back to unit size however many
            # tokens it averaged: this is what resharpens (theory.md, section 4).
            a, att = self.attn(x)
            x = x + self.ln_1(self.drop(a))
            if self.mlp:
                x = x + self.ln_2(self.drop(self.mlp(x)))
        else:  # post-residual
            a, att = self.attn(x)
            x = self.ln_1(x + self.drop(a))
            if self.mlp:
                x = self.ln_2(x + self.drop(self.mlp(x)))
        return x, att


class Transformer(nn.Module):
    """Token embedding -> blocks -> (final LN for 'pre-final') -> unembedding. No positions."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab + (1 if cfg.bos else 0), cfg.n_embd)   # E; row v: BOS
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


# ------------------------------------------------ an EMA of the weights (theory.md, section 5)
class EMA:
    """A shadow copy of the parameters, averaged after every optimizer step (decay omega):
        avg_t = (1 - beta_t) avg_{t-1} + beta_t theta_t,   beta_t = (1 - omega) / (1 - omega^t)
    This is Adam's bias correction as a weight: avg_t averages theta_1 .. theta_t with weights
    proportional to omega^(t - k), so the initialization never enters it (theory.md, 5)."""

    def __init__(self, model, decay):
        self.decay, self.t = decay, 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def beta(self, t):
        return (1 - self.decay) / (1 - self.decay**t)

    @torch.no_grad()
    def update(self, model):
        self.t += 1
        beta = self.beta(self.t)
        for avg, p in zip(self.shadow, model.parameters()):
            avg.lerp_(p, beta)  # avg + beta_t * (p - avg)

    def averaged(self):   # the weights to evaluate
        return self.shadow


@torch.no_grad()
def averaged_copy(model, averager):
    """A copy of the model holding the averaged weights; the model keeps the raw ones."""
    model = copy.deepcopy(model)
    for a, p in zip(averager.averaged(), model.parameters()):
        p.copy_(a)
    return model


# -------------------------------------------------------------------------------------- training
def pick_device(name):   # 'auto': a CUDA GPU, else Apple's MPS, else the CPU
    if name != "auto":
        return name
    mps = torch.backends.mps.is_available()
    return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"


def learning_rate(cfg, step):
    """Constant, or a cosine decay from cfg.lr at step 1 to zero at the last step."""
    if cfg.lr_schedule == "cosine":
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / max(cfg.steps - 1, 1)))
    return cfg.lr


def train(cfg, log=print, average_with=None, task=None):
    """Train on the task (default Set Complement). Returns (model, averagers, losses): the
    last weights, and one averager per function model -> averager in `average_with`
    (default: cfg.ema's EMA, if cfg.ema > 0)."""
    task, device = task or SetComplement(cfg), pick_device(cfg.device)
    torch.manual_seed(cfg.seed)                      # the initialization
    gen = torch.Generator().manual_seed(cfg.seed)    # the training data, on the CPU
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    default = [lambda m: EMA(m, cfg.ema)] if cfg.ema > 0 else []
    averagers = [make(model) for make in (default if average_with is None else average_with)]
    losses, floor = [], task.loss_floor()
    every, t5 = max(1, cfg.steps // 8), None   # t5: the clock after the first, slower steps
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        seq = task.sample(cfg.batch_size, cfg.train_len + 1, gen).to(device)
        x, y = seq[:, :-1], seq[:, 1:]   # (B, T): y[:, t] samples the target of x[:, :t+1]
        logp = F.log_softmax(model(x), dim=-1)   # (B, T, v)
        if cfg.targets == "exact":   # the same expected gradient, without the sampling noise
            loss = -(task.target(x) * logp).sum(-1).mean()
        else:
            loss = F.nll_loss(logp.reshape(-1, cfg.vocab), y.reshape(-1))
        losses.append(loss.item())   # .item() waits for the device: once per step
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"the loss became {losses[-1]} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for avg in averagers:
            avg.update(model)
        if step == 5:
            t5 = time.time()
        if step % every == 0 or step in (min(10, cfg.steps), cfg.steps):   # at 10, then 8 times
            rate = (step - 5) / max(time.time() - t5, 1e-9) if t5 else 0.0
            recent = losses[-every:]
            log(f"step {step:5d}/{cfg.steps} | loss {sum(recent) / len(recent):.4f} (floor "
                f"{floor:.4f}) | {rate:.0f} steps/s | ETA "
                + (f"{(cfg.steps - step) / rate:.0f}s" if rate else "-"))
    weights = list(model.parameters()) + [w for a in averagers for w in a.averaged()]
    if not all(torch.isfinite(w).all() for w in weights):
        raise FloatingPointError(f"the weights became NaN or infinite by step {cfg.steps}")
    return model, averagers, losses


# ------------------------------------------- evaluation at every length (theory.md, sections 2-4)
def numbers_per_input(cfg, T):
    """About how many numbers one input of T tokens holds in evaluate(): per position, its
    logits (v), a layer's activations (4 n_embd), every layer's attention (n_head (T + 1))."""
    return T * (cfg.vocab + 4 * cfg.n_embd + (T + 1) * cfg.n_head * cfg.n_layer)


@torch.no_grad()
def evaluate(model, n_perm=EVAL_PERMS, task=None):
    """Metrics at every prefix length s = 1 .. v-1 of the task (default Set Complement),
    averaged over n_perm fixed inputs: one pass over a whole permutation gives every length;
    chunks of inputs bound the memory."""
    cfg, was_training, device = model.cfg, model.training, next(model.parameters()).device
    task = task or SetComplement(cfg)
    model.eval()
    idx = task.eval_inputs(n_perm)                             # (N, T), on the CPU
    N, T = idx.shape
    total = {}
    for chunk in idx.split(max(1, EVAL_CHUNK // numbers_per_input(cfg, T))):
        logits, atts = model(chunk.to(device), return_attn=True)   # (n, T, v)
        logits = logits.cpu().double()   # float64 on the CPU (MPS has none): TVDs of 1e-30
        p = task.target(chunk, torch.double)                   # (n, T, v)
        seen = p == 0          # the seen tokens; for a language, every illegal next token
        logq = F.log_softmax(logits, dim=-1)
        q = logq.exp()
        # TVD to the exact target as the total excess of q over p* (half the L1 distance,
        # and exact even when as small as 1e-30); the mass on seen (invalid) tokens.
        tvd = (q - p).clamp_min(0).sum(-1)
        invalid = (q * seen).sum(-1)
        # KL(p* || q): sums only over the unseen tokens, where p* > 0.
        kl = torch.where(seen, 0.0, p * (p.clamp_min(1e-30).log() - logq)).sum(-1)
        # Mean logit of the unseen tokens minus mean logit of the seen ones (theory.md, 1).
        gap = ((logits * ~seen).sum(-1) / (~seen).sum(-1)
               - (logits * seen).sum(-1) / seen.sum(-1))
        # Attention entropy, mean over heads and layers; uniform attention gives the most.
        att = torch.stack(atts).cpu().double()                 # (L, n, nh, T, T)
        h = -(att * att.clamp_min(1e-300).log()).sum(-1)       # (L, n, nh, T)
        batch = dict(tvd=tvd, invalid_mass=invalid, kl=kl, logit_gap=gap,
                     attn_entropy=h.mean(dim=(0, 2)))          # (n, T)
        if len(atts) > 1:   # a deeper model: each layer's entropy too
            batch.update({f"attn_entropy_layer{i + 1}": h[i].mean(1) for i in range(len(h))})
        total = {key: total.get(key, 0) + m.sum(0) for key, m in batch.items()}   # row sums
    model.train(was_training)
    lengths = list(range(1, T + 1))
    return {"length": lengths, **{key: [float(x) / N for x in m] for key, m in total.items()},
            "log_positions": [math.log(s + (1 if cfg.bos else 0)) for s in lengths]}


# ------------------------------- the main command's figures (matplotlib's object API: no screen)
def new_figure(ncols=1):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5.2 * ncols, 3.8), layout="constrained")
    return fig, fig.subplots(1, ncols)


def plot_length(metrics, cfg, raw=None, average="EMA", laws=True):
    """length.png. Left: TVD, 0 to 1. Middle: the logit gap (log scale) and theory.md's laws
    matched at the longest training length L: 1/s (Pre-Norm) and v / sqrt(s (v - s)) (Post-
    Norm). Right: attention entropy minus log(positions seen): 0 is uniform attention."""
    fig, axes = new_figure(3)
    s, L, v = metrics["length"], cfg.train_len, cfg.vocab
    runs = ([(raw, "tab:gray", 1.2, "raw weights")] if raw else []) + [
        (metrics, "tab:blue", 2, average if raw else "model")]
    for m, color, lw, label in runs:
        axes[0].plot(s, m["tvd"], color=color, lw=lw, label=label)
        axes[1].plot(s, m["logit_gap"], color=color, lw=lw)
        axes[2].plot(s, [h - u for h, u in zip(m["attn_entropy"], m["log_positions"])],
                     color=color, lw=lw)
    if laws:   # Set Complement's laws (theory.md, sections 2 and 4)
        g = metrics["logit_gap"][L - 1]
        axes[1].plot(s, [g * L / x for x in s], "k:", label="law of pre: 1/s")
        axes[1].plot(s, [g * math.sqrt(L * (v - L) / (x * (v - x))) for x in s], "k--", lw=1,
                     label="law of post: v / sqrt(s (v-s))")
    for ax, title, y in zip(axes, ("TVD to the exact target", "logit gap: unseen - seen",
                                   "attention entropy - log(positions)"),
                            (dict(ylim=(0, 1)), dict(yscale="log"), dict(ylim=(-1, 0.2)))):
        ax.axvspan(0.5, L + 0.5, color="0.9", label="training lengths", zorder=0)
        ax.set(xlabel="prefix length s", title=title, xlim=(0.5, s[-1] + 0.5), **y)
        ax.legend(fontsize=7)
    fig.suptitle(f"norm={cfg.norm}, targets={cfg.targets}, seed={cfg.seed}", fontsize=10)
    return fig


# ----------------------------- theory.md's construction, by hand, in the model class that trains
def hand_built(vocab, norm, gamma=1.0):
    """One layer, one head, n_embd = 2v, no MLP, float64, and
      W_Q = W_K = 0          every score is 0, so attention is uniform over the prefix
      E[x] = e_(v+x)         token x sits in the second half of the features
      W_V W_O                writes the centred one-hot e_x - 1/v into the first half
      U[j] = -gamma e_j      logit j reads feature j, so seen tokens are pushed down
    The readout never sees the second half, so B = E U = 0. (nn.Linear stores W as (out, in):
    the transpose of theory.md's row-vector matrices.)"""
    v, n = vocab, 2 * vocab   # float64, so that TVDs far below 1e-7 are exact
    model = Transformer(Config(vocab=v, n_embd=n, n_head=1, n_layer=1, norm=norm)).double()
    attn, eye = model.blocks[0].attn, lambda k: torch.eye(k, dtype=torch.double)
    with torch.no_grad():
        for p in model.parameters():   # LayerNorms keep gain 1 and bias 0
            if p.dim() == 2:
                p.zero_()
        model.wte.weight[:, v:] = eye(v)
        attn.c_attn.weight[2 * n:3 * n][:v, v:] = eye(v) - 1.0 / v   # W_V
        attn.c_proj.weight.copy_(eye(n))                              # W_O
        model.lm_head.weight[:, :v] = -gamma * eye(v)
    return model.eval()


# ======================================= Part 2: what reproduces the experiments (skip at first)

import argparse  # noqa: E402  (Part 2's own imports, here so that Part 1 reads alone)
import contextlib  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict, astuple, replace  # noqa: E402

# ----------------------------------------------------------------------------- BEMA


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


def averagers_for(cfg):
    """What train() should average: BEMA if cfg asks for it, else its default (cfg.ema)."""
    return [BEMA] if cfg.bema else None


def average_name(cfg):
    return "BEMA" if cfg.bema else f"EMA {cfg.ema}" if cfg.ema > 0 else "none"

# ----------------------------------------------------------------------------- languages
# Formal languages with several legal next tokens: Dyck-(k, D) and Shuffle-k, as tasks with
# SetComplement's four methods. Tokens: 0 .. k-1 open brackets, k .. 2k-1 their closes, 2k
# END. A stream is a run of strings, each ended by END, after which the next string starts
# from the empty state; so every position has an exact next-token distribution, given by a
# small automaton (theory.md, Appendix D).


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


def language_config(base=None, **changes):
    """A Config for a language: its vocabulary is always 2k + 1 (k opens, k closes, END)."""
    cfg = replace(base or Config(), **changes)
    return replace(cfg, vocab=2 * cfg.brackets + 1)


class Language:
    """Dyck-(k, D) or Shuffle-k (cfg.task 'dyck' or 'shuffle'), with SetComplement's methods."""

    def __init__(self, cfg):
        assert cfg.vocab == 2 * cfg.brackets + 1, "make a language's Config with language_config"
        self.cfg = cfg
        self.name = (f"Dyck-({cfg.brackets}, {cfg.max_depth})" if cfg.task == "dyck"
                     else f"Shuffle-{cfg.brackets}")

    def sample(self, n, T, generator=None):
        """n streams of T tokens, each token drawn from the automaton's distribution."""
        state, tokens = language_state(self.cfg, n), []
        for _ in range(T):
            tok = torch.multinomial(language_next(self.cfg, state), 1, generator=generator)[:, 0]
            language_step(self.cfg, state, tok)
            tokens.append(tok)
        return torch.stack(tokens, dim=1)

    def target(self, idx, dtype=torch.float):
        """The exact next-token distribution after every prefix: (B, T) -> (B, T, v)."""
        state, out = language_state(self.cfg, idx.shape[0]), []
        for t in range(idx.shape[1]):
            language_step(self.cfg, state, idx[:, t].cpu())
            out.append(language_next(self.cfg, state, dtype))
        return torch.stack(out, dim=1).to(idx.device)

    def eval_inputs(self, n):
        """Fixed streams of 4 x train_len tokens: positions up to 4 times the training's."""
        g = torch.Generator().manual_seed(EVAL_SEED)
        return self.sample(n, 4 * self.cfg.train_len, g)

    def loss_floor(self):
        """The target's entropy over the training positions, estimated on 2000 fixed streams."""
        p = self.target(self.eval_inputs(2000)[:, : self.cfg.train_len], torch.double)
        return -(p * p.clamp_min(1e-30).log()).sum(-1).mean().item()


TASKS = {"complement": SetComplement, "dyck": Language, "shuffle": Language}


def make_task(cfg):
    """The task object cfg names, for train() and evaluate()."""
    return TASKS[cfg.task](cfg)

# ----------------------------------------------------------------------------- files
# Every file is written to its own temporary name in the target folder, then renamed: a
# reader never sees half a file, and two runs never share a temporary file. A run's files
# are written together, under a lock on the folder (POSIX), with its JSON record last; the
# record lists the sha256 of every file written with it, and is deleted before the others
# are replaced. So: a figure whose hash is in the JSON beside it is from that run, and a
# folder with no JSON was interrupted while writing.


class WriteError(RuntimeError):
    pass


def write_bytes(path, data):
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp's 0600 would differ from the other files
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def figure_bytes(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def json_bytes(obj):
    return (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode("utf-8")


@contextlib.contextmanager
def folder_lock(folder):
    """Exclusive while it lasts, against other runs writing the same folder (POSIX only)."""
    try:
        import fcntl
    except ImportError:    # Windows: no lock; each file is still whole
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Interrupted(Exception):
    """A signal asked the run to stop: Ctrl-C (SIGINT), SIGTERM or SIGHUP (main's handler)."""

    def __init__(self, signum, written=None):
        super().__init__(signum)
        self.signum, self.written = signum, written


def write_outputs(out, files, record_name=None, record=None, extra=None):
    """Write files {name: bytes} into out, then extra {path: bytes} (a checkpoint, anywhere),
    then the JSON record (if any) listing the sha256 of all of them, all under one lock.
    Everything is rendered before this is called, so a failure here is the disk's."""
    path, done, extra = None, [], extra or {}
    try:
        os.makedirs(out, exist_ok=True)
        with folder_lock(out):
            if record_name and os.path.exists(os.path.join(out, record_name)):
                os.remove(os.path.join(out, record_name))
            for path, data in [(os.path.join(out, n), d) for n, d in files.items()] + list(
                    extra.items()):
                write_bytes(path, data)
                done.append(path)
            if record_name:
                hashes = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
                path = os.path.join(out, record_name)
                write_bytes(path, json_bytes({**record, "files": hashes}))
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise WriteError(f"could not write {path or out} ({why}); written: "
                         f"{', '.join(done) or 'nothing'}" +
                         (f"; {record_name} was not, so {out} holds an incomplete set"
                          if record_name and done else "")) from None
    except Interrupted as e:
        e.written = done
        raise
    return [os.path.join(out, name) for name in files] + list(extra) + (
        [os.path.join(out, record_name)] if record_name else [])


def checkpoint_hash(ckpt):
    """sha256 of a checkpoint's config and of every tensor's bytes, read in place (no copy)."""
    h = hashlib.sha256(json.dumps(ckpt["config"], sort_keys=True).encode("utf-8"))
    for name, tensor in list(ckpt["model"].items()) + list(enumerate(ckpt.get("ema", []))):
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode("utf-8"))
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def checkpoint_bytes(model, averager, cfg):
    """Config, raw weights and averaged weights (if any), with the sha256 of all of them, so
    that a changed byte is found when the file is loaded. A view of one buffer, not a copy:
    the weights are held once more, not three times."""
    ckpt = {"config": asdict(cfg), "model": model.state_dict()}
    if averager:
        ckpt["ema"] = [a.cpu() for a in averager.averaged()]
    ckpt["sha256"] = checkpoint_hash(ckpt)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    return buf.getbuffer()


def load_checkpoint(path, raw=False, device="cpu"):
    """A ready model in eval mode: the averaged weights if the run had them (unless raw)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if checkpoint_hash(ckpt) != ckpt["sha256"]:
            raise ValueError(f"{path} is damaged: its contents do not match their sha256")
        model = Transformer(Config(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
        shapes = [p.shape for p in model.parameters()]
        if "ema" in ckpt and [t.shape for t in ckpt["ema"]] != shapes:
            raise ValueError(f"{path}: its averaged weights do not fit its model")
    except ValueError:
        raise
    except Exception as e:   # a damaged file can fail anywhere in torch.load's parsers
        raise ValueError(f"{path} is not a resharpen.py checkpoint ({e or type(e).__name__})")
    if "ema" in ckpt and not raw:
        with torch.no_grad():
            for p, s in zip(model.parameters(), ckpt["ema"]):
                p.copy_(s)
    return model.to(device).eval()

# ----------------------------------------------------------------------------- main command
# python resharpen.py [flags]: train, evaluate at every length, print, write the figures


def summarize(metrics, train_len):
    """Mean TVD over the training lengths, over the longer ones (None if there are none,
    train_len = v - 1), and at the longest."""
    tvd = metrics["tvd"]
    beyond = tvd[train_len:]
    return {"tvd_train": sum(tvd[:train_len]) / len(tvd[:train_len]),
            "tvd_extrap": sum(beyond) / len(beyond) if beyond else None,
            "tvd_last": tvd[-1]}


def format_table(metrics, train_len, raw=None):
    """A compact table, one row per selected length."""
    n = len(metrics["length"])
    rows = sorted({1, 2, 4, train_len, train_len + 1, 2 * train_len, n} | set(range(8, n, 8)))
    log_n = "log(s+1)" if metrics["log_positions"][0] > 0 else "log s"   # BOS is one more
    head = f"{'s':>4} {'TVD':>7} {'invalid':>8} {'KL':>7} {'H(attn)':>8} {log_n:>8} {'gap':>7}"
    lines = [head + (f" {'TVD raw':>8}" if raw else "")]
    for s in (r for r in rows if 1 <= r <= n):
        i = s - 1
        line = (f"{s:>4} {metrics['tvd'][i]:7.4f} {metrics['invalid_mass'][i]:8.4f} "
                f"{metrics['kl'][i]:7.4f} {metrics['attn_entropy'][i]:8.3f} "
                f"{metrics['log_positions'][i]:8.3f} {metrics['logit_gap'][i]:7.3f}")
        line += f" {raw['tvd'][i]:8.4f}" if raw else ""
        lines.append(line + ("   <- longest training length" if s == train_len else ""))
    return "\n".join(lines)


def plot_loss(losses, floor):
    """loss.png: the training loss, smoothed over 50 steps, and its floor."""
    fig, ax = new_figure()
    k = min(50, len(losses))
    smooth = [sum(losses[i:i + k]) / k for i in range(len(losses) - k + 1)]
    ax.plot(range(k, len(losses) + 1), smooth, lw=1, label=f"loss ({k}-step mean)")
    ax.axhline(floor, color="k", ls="--", lw=1, label="floor: entropy of the target")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="training loss")
    ax.legend(fontsize=8)
    return fig


def finite(metrics):
    return all(math.isfinite(x) for key, xs in metrics.items() if key != "length" for x in xs)


def run_one(cfg, out, save=None):
    """The default command: train, evaluate, print the table, write metrics and figures."""
    task = make_task(cfg)
    print(f"{task.name}: v={cfg.vocab}, train lengths 1..{cfg.train_len}, norm={cfg.norm} "
          f"[{NORMS[cfg.norm]}], averaging={average_name(cfg)}, targets={cfg.targets}, "
          f"lr={cfg.lr} {cfg.lr_schedule}, seed={cfg.seed}, device={pick_device(cfg.device)}")
    t0 = time.time()
    model, averagers, losses = train(cfg, average_with=averagers_for(cfg), task=task)
    train_time = time.time() - t0
    metrics = raw = evaluate(model, task=task)
    if averagers:
        metrics = evaluate(averaged_copy(model, averagers[0]), task=task)
    else:
        raw = None
    if not (finite(metrics) and (raw is None or finite(raw))):
        raise FloatingPointError("the metrics are not finite (the logits overflow)")
    print(f"\nevaluated on {EVAL_PERMS} fixed inputs" +
          (f" with the {average_name(cfg)} weights (raw weights in the last column)"
           if raw else ""))
    print(format_table(metrics, cfg.train_len, raw))
    summary = summarize(metrics, cfg.train_len)
    n = len(metrics["length"])
    extrap = (f"{cfg.train_len + 1}..{n} {summary['tvd_extrap']:.4f}"
              if summary["tvd_extrap"] is not None else "none (every length was trained)")
    line = f"\nmean TVD: training lengths {summary['tvd_train']:.4f} | extrapolation {extrap}"
    if raw and summary["tvd_extrap"] is not None:
        r = summarize(raw, cfg.train_len)
        line += f"   (raw weights: {r['tvd_train']:.4f} | {r['tvd_extrap']:.4f})"
    print(line)
    # Everything is rendered before anything is written.
    laws = isinstance(task, SetComplement)
    files = {"length.png": figure_bytes(plot_length(metrics, cfg, raw, average_name(cfg), laws)),
             "loss.png": figure_bytes(plot_loss(losses, task.loss_floor()))}
    record = {"config": asdict(cfg), **metrics, "summary": summary,
              "train_seconds": round(train_time, 2)}
    if raw:
        record["raw"] = {**raw, "summary": summarize(raw, cfg.train_len)}
    extra = {}
    if save:
        extra[save] = checkpoint_bytes(model, averagers[0] if averagers else None, cfg)
        record["checkpoint"] = {"path": save, "sha256": hashlib.sha256(extra[save]).hexdigest()}
    written = write_outputs(out, files, "metrics.json", record, extra)
    print(f"wrote {', '.join(written)} | {time.time() - t0:.1f}s")

# ----------------------------------------------------------------------------- comparison
# python resharpen.py --compare: every claim of the paper, 3 seeds each (README, "Results")

COMPARE_SEEDS = 3
COMPARE_EMA = 0.999
AVERAGES = ("raw", "ema", "bema")
AVERAGE_LABELS = {"raw": "none", "ema": f"EMA {COMPARE_EMA}", "bema": "BEMA", "ema99": "EMA 0.99"}
AVERAGERS = {"ema": lambda m: EMA(m, COMPARE_EMA), "ema99": lambda m: EMA(m, 0.99), "bema": BEMA}
COLORS = {"pre": "tab:red", "pre-final": "tab:orange", "post": "tab:blue",
          "post-residual": "tab:purple"}


REGIMES = (("sampled", "constant"), ("sampled", "cosine"), ("exact", "constant"),
           ("exact", "cosine"))   # (targets, learning-rate schedule): where the noise comes from


def compare_grid(base, norms=tuple(NORMS), regimes=REGIMES, lrs=(None,), seeds=None):
    """Every run of the comparison: each placement in each regime (at each rate), COMPARE_SEEDS
    seeds. Each run trains once and is evaluated with its raw, EMA and BEMA weights: the
    averages never feed back into training, so 'EMA off' is exactly the raw weights."""
    seeds = [base.seed + i for i in range(COMPARE_SEEDS)] if seeds is None else seeds
    return [replace(base, norm=n, targets=t, lr_schedule=sch, lr=lr or base.lr, ema=0.0,
                    bema=False, seed=s)
            for t, sch in regimes for n in norms for lr in lrs for s in seeds]


def tune_rates(base, norms, regimes, lrs, device):
    """Each placement in each regime trains at every rate on the first seed; the rate with
    the lowest training-length TVD (EMA weights) is chosen, and the other seeds train at it.
    Returns (every run, wall, workers, {(norm, targets, schedule): chosen rate})."""
    first, wall, workers = run_grid(compare_grid(base, norms, regimes, lrs, [base.seed]), device)
    key = lambda c: (c.norm, c.targets, c.lr_schedule)
    chosen = {}
    for c, r, _ in sorted(first, key=lambda d: summarize(d[1]["ema"], base.train_len)["tvd_train"]):
        chosen.setdefault(key(c), c.lr)
    rest = [replace(c, seed=base.seed + i) for c, _, _ in first if c.lr == chosen[key(c)]
            for i in range(1, COMPARE_SEEDS)]
    more, wall2, _ = run_grid(rest, device)
    return first + more, wall + wall2, workers, chosen


def compare_one(cfg, averages=("ema", "bema"), threads=None):
    """Train one configuration; evaluate its raw weights and each average (AVERAGERS)."""
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    task = make_task(cfg)
    model, avgs, _ = train(cfg, log=lambda *a: None,
                           average_with=[AVERAGERS[a] for a in averages], task=task)
    result = {"raw": evaluate(model, task=task)}
    result.update({a: evaluate(averaged_copy(model, avg), task=task)
                   for a, avg in zip(averages, avgs)})
    if not all(finite(m) for m in result.values()):
        raise FloatingPointError(f"the metrics of {cfg} are not finite")
    return cfg, result, time.time() - t0


def usable_cores():
    """The cores this process may run on (taskset, containers), not all the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _ignore_ctrl_c():
    """Worker processes leave Ctrl-C to the main process, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_grid(runs, device, averages=("ema", "bema")):
    """Train and evaluate every run: on every CPU core at once (one thread each), or one
    at a time on a GPU, with a progress line per run. Returns (results, wall, workers)."""
    workers = min(usable_cores(), len(runs)) if device == "cpu" else 1
    print(f"{len(runs)} training runs on {device}, {workers} at a time", flush=True)
    t0, done = time.time(), []
    if workers > 1:
        import multiprocessing
        # The workers and multiprocessing's helper process start with SIGHUP ignored (a
        # closed terminal hangs up the whole group): this process stops them itself.
        hup = getattr(signal, "SIGHUP", None)
        old = signal.signal(hup, signal.SIG_IGN) if hup else None
        try:
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_ignore_ctrl_c)
        finally:
            if hup:
                signal.signal(hup, old)
        job = functools.partial(compare_one, averages=averages, threads=1)
        results = pool.imap_unordered(job, runs)
    else:
        pool, results = None, (compare_one(cfg, averages) for cfg in runs)
    try:
        for cfg, result, seconds in results:
            done.append((cfg, result, seconds))
            s = " ".join(f"{a} {summarize(m, cfg.train_len)['tvd_extrap']:.3f}"
                         for a, m in result.items())
            extra = "".join([f" dropout {cfg.dropout}" if cfg.dropout else "",
                             " bos" if cfg.bos else "",
                             f" {cfg.attn_scale}" if cfg.attn_scale != "none" else ""])
            print(f"[{len(done):2d}/{len(runs)}] {make_task(cfg).name:13s} {cfg.norm:13s} "
                  f"{cfg.targets:7s} {cfg.lr_schedule:8s} seed {cfg.seed}{extra} | extrapolation "
                  "TVD "
                  f"{s} | {seconds:.0f}s | ETA {eta(done, len(runs), workers):.0f}s", flush=True)
    finally:
        if pool:
            pool.terminate()
    done.sort(key=lambda d: runs.index(d[0]))   # grid order, whichever finished first
    return done, time.time() - t0, workers


def eta(done, total, workers):
    """Seconds left: the mean run time so far, times the runs left per worker."""
    mean = sum(seconds for _, _, seconds in done) / len(done)
    return mean * math.ceil((total - len(done)) / workers)


def compare_rows(runs):
    """Group finished runs by configuration: {(norm, targets, schedule, average): [metrics]}."""
    rows = {}
    for cfg, result, _ in runs:
        for avg in AVERAGES:
            key = (cfg.norm, cfg.targets, cfg.lr_schedule, avg)
            rows.setdefault(key, []).append(result[avg])
    return rows


def mean_sd(values, digits=3):
    """'mean +- sample standard deviation', for the tables."""
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / max(len(values) - 1, 1))
    return f"{mean:.{digits}f} +- {sd:.{digits}f}"


def gap_laws(v):
    """theory.md's laws for the logit gap, as (norm, what, says, function of (s, gap)) that
    should be constant in s: Pre-Norm's gap falls like 1/s (section 2), Post-Norm's like
    v / sqrt(s (v - s)) (section 4: slower, and never below its value at s = v / 2)."""
    return [("pre", "gap x s", "constant: the gap falls like 1/s", lambda s, g: g * s),
            ("post", "gap x sqrt(s (v-s)) / v",
             "constant: the gap follows v / sqrt(s (v-s)), lowest at s = v/2",
             lambda s, g: g * math.sqrt(s * (v - s)) / v)]


def columns(L, v):
    """The comparison's columns, fixed before any run (theory.md, Appendix F): mean TVD over the
    training lengths; TVD at 1.5, 2 and 4 times the longest training length L (where that
    length exists, s <= v - 1); mean TVD over every longer length; TVD at s = v - 1."""
    cols = [("training lengths", lambda m: summarize(m, L)["tvd_train"])]
    for r in (1.5, 2, 4):
        s = round(r * L)
        if L < s <= v - 1:
            cols.append((f"s = {s} ({r:g} L)", lambda m, s=s: m["tvd"][s - 1]))
    return cols + [(f"mean, s = {L + 1}..{v - 1}", lambda m: summarize(m, L)["tvd_extrap"]),
                   (f"s = {v - 1}", lambda m: m["tvd"][-1])]


def crossover(post, rival):
    """The shortest length from which post's TVD (mean over seeds) is below rival's at every
    longer length; None if it is not below at the longest."""
    mean = lambda runs: [sum(c) / len(c) for c in zip(*[m["tvd"] for m in runs])]
    a, b, start = mean(post), mean(rival), None
    for s in range(len(a), 0, -1):
        if a[s - 1] >= b[s - 1]:
            break
        start = s
    return start


def compare_summary(rows, L, v, norms, regimes):
    """Every number of the comparison's tables, for compare.json and the README's tests:
    {regime: {norm: {average: {column: [one value per seed]}}, 'crossover': {average: s}}}."""
    out = {}
    for t, sch in regimes:
        r = out[f"{t}, {sch}"] = {}
        for norm in norms:
            r[norm] = {avg: {name: [f(m) for m in rows[(norm, t, sch, avg)]]
                             for name, f in columns(L, v)} for avg in AVERAGES}
        if {"post", "pre-final"} <= set(norms):
            r["crossover"] = {avg: crossover(rows[("post", t, sch, avg)],
                                             rows[("pre-final", t, sch, avg)])
                              for avg in AVERAGES}
    return out


def compare_table(summary, L, v, norms, wall, n_runs, workers, laws=None):
    """Markdown: the headline (placements x regimes, EMA weights), then every regime in full."""
    mean = lambda xs: sum(xs) / len(xs)
    tested = [r for r in (2, 4) if r * L <= v - 1]   # 2 L, and 4 L where it is a test length
    at = [f"s = {r * L} ({r} L)" for r in tested]      # their names in columns()
    regimes = list(summary)
    out = ["### Headline: TVD on the training lengths / at " + " / at ".join(
               f"{r} L = {r * L}" for r in tested) +
           f" (EMA {COMPARE_EMA}, mean of {COMPARE_SEEDS} seeds)", "",
           "| placement | " + " | ".join(regimes) + " |",
           "|---" * (len(regimes) + 1) + "|"]
    for norm in norms:
        cells = [" / ".join(f"{mean(summary[r][norm]['ema'][c]):.4f}"
                            for c in ["training lengths"] + at) for r in regimes]
        out.append(f"| `{norm}` | " + " | ".join(cells) + " |")
    if "post" in norms and "pre-final" in norms:
        cross = [summary[r]["crossover"]["ema"] for r in regimes]
        out.append("| `post` below `pre-final` from s = | " +
                   " | ".join(str(c) if c else "never" for c in cross) + " |")
    names = [name for name, _ in columns(L, v)]
    for r in regimes:
        out += ["", f"### {r} (TVD, mean +- sd over seeds)", "",
                "| placement | weights | " + " | ".join(names) + " |",
                "|---" * (len(names) + 2) + "|"]
        for norm in norms:
            for avg in AVERAGES:
                vals = summary[r][norm][avg]
                out.append(f"| `{norm}` | {AVERAGE_LABELS[avg]} | " +
                           " | ".join(mean_sd(vals[n], 4) for n in names) + " |")
        if "crossover" in summary[r]:
            out += ["", "`post` below `pre-final` at every length from s = " + ", ".join(
                f"{summary[r]['crossover'][a] or 'never'} ({AVERAGE_LABELS[a]})"
                for a in AVERAGES) + "."]
    if laws:
        out += ["", laws]
    out += ["", f"Mean +- standard deviation over {COMPARE_SEEDS} seeds. {n_runs} training runs, "
            f"{wall:.0f} s wall in {workers} worker process(es)."]
    return "\n".join(out)


def laws_table(rows, v):
    """theory.md's laws on the trained models (sampled targets, constant rate, EMA weights)."""
    out = ["### The laws of theory.md on the trained models (sampled, constant; EMA weights)",
           "", "| norm | quantity, over s = 1 .. v-1 | theory says | min | max |",
           "|---" * 5 + "|"]
    for norm, what, says, law in gap_laws(v):
        runs = rows[(norm, "sampled", "constant", "ema")]
        vals = [law(s, g) for m in runs for s, g in zip(m["length"], m["logit_gap"])]
        out.append(f"| `{norm}` | {what} | {says} | {min(vals):.3f} | {max(vals):.3f} |")
    for norm in ("pre", "pre-final", "post"):
        runs = rows[(norm, "sampled", "constant", "ema")]
        vals = [h - u for m in runs for h, u in zip(m["attn_entropy"], m["log_positions"])]
        out.append(f"| `{norm}` | attention entropy - log s | 0: uniform attention | "
                   f"{min(vals):.3f} | {max(vals):.3f} |")
    return "\n".join(out)


def rates_table(done, chosen, summary, L):
    """The rate sweep on the first seed: training-length TVD and TVD at 2 L, EMA weights."""
    out = ["### Learning rates (first seed, EMA weights; the chosen rate has the lowest TVD on "
           "the training lengths; the other seeds ran at it)", "",
           "| regime | placement | lr | TVD, training lengths | TVD at 2 L | chosen |",
           "|---" * 6 + "|"]
    seed = min(c.seed for c, _, _ in done)
    for c, r, _ in done:
        if c.seed == seed:
            m = r["ema"]
            out.append(f"| {c.targets}, {c.lr_schedule} | `{c.norm}` | {c.lr:g} | "
                       f"{summarize(m, L)['tvd_train']:.4f} | {m['tvd'][2 * L - 1]:.4f} | "
                       f"{'yes' if chosen[(c.norm, c.targets, c.lr_schedule)] == c.lr else ''} |")
    return "\n".join(out)


def layer_entropy_table(rows, cfg, norms, regimes):
    """Dispersion per layer: attention entropy minus log(positions), EMA weights, mean over
    seeds (0: uniform attention over the prefix)."""
    L, v = cfg.train_len, cfg.vocab
    at = sorted({L, 2 * L, v - 1} & set(range(1, v)))
    out = ["### Attention entropy minus log(positions), per layer (EMA weights, mean of seeds; "
           "0 = uniform)", "", "| regime | placement | layer | " +
           " | ".join(f"s = {s}" for s in at) + " |", "|---" * (3 + len(at)) + "|"]
    for t, sch in regimes:
        for norm in norms:
            runs = rows[(norm, t, sch, "ema")]
            for i in range(1, cfg.n_layer + 1):
                cells = [sum(m[f"attn_entropy_layer{i}"][s - 1] - m["log_positions"][s - 1]
                             for m in runs) / len(runs) for s in at]
                out.append(f"| {t}, {sch} | `{norm}` | {i} | " +
                           " | ".join(f"{x:.3f}" for x in cells) + " |")
    return "\n".join(out)


def _band(ax, xs, curves, label, color, lw=2, zorder=2, ls="-"):
    mean = [sum(c) / len(c) for c in zip(*curves)]
    ax.fill_between(xs, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                    color=color, alpha=0.3, lw=0, zorder=zorder)
    ax.plot(xs, mean, color=color, lw=lw, label=label, zorder=zorder, ls=ls)
    return mean


def plot_compare_norms(rows, cfg):
    """compare_norms.png, the README's first figure. Left: the logit gap against length
    per norm placement, with theory.md's laws matched at the longest training length.
    Right: TVD against length. EMA weights; mean and min-max band over the seeds."""
    fig, (ax1, ax2) = new_figure(2)
    fig.set_size_inches(10.4, 4.6)
    s, L, v = list(range(1, cfg.vocab)), cfg.train_len, cfg.vocab
    for ax in (ax1, ax2):
        ax.axvspan(0.5, L + 0.5, color="0.9", label="training lengths")
    for norm in ("pre", "post-residual", "pre-final", "post"):   # the remedy drawn last
        runs = rows[(norm, "sampled", "constant", "ema")]
        top = dict(lw=3, zorder=5) if norm == "post" else dict(lw=1.5, zorder=3)
        gap = _band(ax1, s, [m["logit_gap"] for m in runs], f"{norm}: {NORMS[norm].split(':')[0]}",
                    COLORS[norm], **top)
        _band(ax2, s, [m["tvd"] for m in runs], None, COLORS[norm], **top)
        law = {"pre": lambda x: L / x, "post": lambda x: math.sqrt(L * (v - L) / (x * (v - x)))}
        if norm in law:
            ax1.plot(s, [gap[L - 1] * law[norm](x) for x in s], ":", color="k", lw=1.5, zorder=6,
                     label="theory: 1/s (pre), v/sqrt(s(v-s)) (post)" if norm == "post" else None)
    ax1.set(xlabel="prefix length s", ylabel="logit gap: unseen minus seen", yscale="log",
            title="the gap: Pre-Norm's falls like 1/s, Post-Norm's stays up")
    ax2.set(xlabel="prefix length s", ylabel="TVD to the exact target", ylim=(0, 1),
            title="the error beyond the training lengths")
    ax2.annotate(f"s = {v - 1}: one unseen token left,\nand Post-Norm's gap rises again",
                 xy=(v - 1, 0.03), xytext=(v - 14, 0.3), fontsize=8,
                 arrowprops=dict(arrowstyle="->", lw=0.8))
    for ax in (ax1, ax2):
        ax.set_xlim(0.5, v - 0.5)
    fig.legend(*ax1.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8)
    return fig


def plot_compare_dispersion(rows, cfg):
    """compare_dispersion.png: attention entropy minus log s (0 = uniform attention: full
    dispersion), per norm placement, EMA weights, mean and min-max band."""
    fig, ax = new_figure()
    s = list(range(1, cfg.vocab))
    ax.axvspan(0.5, cfg.train_len + 0.5, color="0.9", label="training lengths")
    ax.axhline(0, color="k", ls="--", lw=1, label="uniform attention")
    for norm in NORMS:
        runs = rows[(norm, "sampled", "constant", "ema")]
        _band(ax, s, [[h - u for h, u in zip(m["attn_entropy"], m["log_positions"])]
                      for m in runs], norm, COLORS[norm], lw=1.5)
    ax.set(xlabel="prefix length s", ylabel="attention entropy - log s (nats)",
           title="distance from uniform attention (0 = uniform)", xlim=(0.5, cfg.vocab - 0.5))
    ax.legend(fontsize=7, loc="lower right")
    return fig


def plot_compare_noise(rows, cfg):
    """compare_noise.png: post-norm TVD per targets/schedule, per weight average."""
    fig, axes = new_figure(2)
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
    return fig


def plot_regimes(rows, cfg, norms, regimes):
    """compare_regimes.png, long.png: TVD against length, one panel per regime, one curve per
    placement (EMA weights; mean and min-max band over seeds), log scale: 0.003 and 0.3 both
    show."""
    fig, axes = new_figure(len(regimes))
    axes = axes if len(regimes) > 1 else [axes]
    fig.set_size_inches(max(3.6 * len(regimes), 5.2), 3.9)
    s, L = list(range(1, cfg.vocab)), cfg.train_len
    for ax, (t, sch) in zip(axes, regimes):
        ax.axvspan(0.5, L + 0.5, color="0.9", label="training lengths")
        for norm in norms:
            top = dict(lw=2.5, zorder=5) if norm == "post" else dict(lw=1.5, zorder=3)
            _band(ax, s, [m["tvd"] for m in rows[(norm, t, sch, "ema")]], norm, COLORS[norm],
                  **top)
        for r in (2, 4):
            if r * L <= cfg.vocab - 1:
                ax.axvline(r * L, color="k", lw=0.6, ls=":")
        ax.set(xlabel="prefix length s", title=f"{t} targets, {sch} lr", yscale="log",
               ylim=(1e-4, 1), xlim=(0.5, cfg.vocab - 0.5))
    axes[0].set_ylabel("TVD to the exact target (log)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
               ncol=len(norms) + 1, fontsize=8)
    return fig


LONG_MODEL = dict(vocab=64, train_len=15, n_embd=128)   # tested to s = 63 = 4.2 x 15
LONG_NORMS = ("pre", "pre-final", "post")
LONG_REGIMES = (("sampled", "constant"), ("exact", "cosine"))   # the noisiest, the quietest


def compare(base, out, long=False, norms=None, regimes=None, lrs=None, command=""):
    """python resharpen.py --compare: every placement in every regime, 3 seeds; writes
    compare.md, compare.json and 4 figures. With long=True (--long): LONG_MODEL's larger
    vocabulary, three placements, two regimes; writes long.md, long.json, long.png.
    norms, regimes: a subset (then only the regimes figure); lrs: rates to tune over."""
    full = norms is None and regimes is None
    norms, regimes, name = norms or tuple(NORMS), regimes or REGIMES, "compare"
    if long:
        base, name = replace(base, **LONG_MODEL), "long"
        norms, regimes = (LONG_NORMS, LONG_REGIMES) if full else (norms, regimes)
    device, chosen = pick_device(base.device), None
    if lrs and len(lrs) > 1:
        done, wall, workers, chosen = tune_rates(base, norms, regimes, lrs, device)
    else:
        base = replace(base, lr=lrs[0]) if lrs else base
        done, wall, workers = run_grid(compare_grid(base, norms, regimes), device)
    kept = [d for d in done if not chosen or d[0].lr == chosen[
        (d[0].norm, d[0].targets, d[0].lr_schedule)]]
    rows, L, v = compare_rows(kept), base.train_len, base.vocab
    summary = compare_summary(rows, L, v, norms, regimes)
    extra = [laws_table(rows, v)] if full and not long else []
    if chosen:
        extra.append(rates_table(done, chosen, summary, L))
    if base.n_layer > 1:
        extra.append(layer_entropy_table(rows, base, norms, regimes))
    table = compare_table(summary, L, v, norms, wall, len(done), workers,
                          "\n\n".join(extra) or None)
    print("\n" + table)
    md = (f"Written by `{command or 'python resharpen.py --' + name}` (v={v}, train lengths "
          f"1..{L}, width {base.n_embd}, {base.n_layer} layer(s){', MLP' if base.mlp else ''}, "
          f"{base.steps} steps, batch {base.batch_size}, lr "
          f"{'tuned' if chosen else base.lr}).\n\n{table}\n") if (chosen or base.n_layer > 1
          or not full) else (
          f"Written by `python resharpen.py --{name}` (v={v}, train lengths 1..{L}, width "
          f"{base.n_embd}, {base.steps} steps, batch {base.batch_size}, lr {base.lr}).\n\n"
          f"{table}\n")
    if long or not full:
        files = {f"{name}.md": md.encode("utf-8"),
                 ("long.png" if long else "compare_regimes.png"):
                     figure_bytes(plot_regimes(rows, base, norms, regimes))}
    else:
        files = {"compare.md": md.encode("utf-8"),
                 "compare_regimes.png": figure_bytes(plot_regimes(rows, base, norms, regimes)),
                 "compare_norms.png": figure_bytes(plot_compare_norms(rows, base)),
                 "compare_dispersion.png": figure_bytes(plot_compare_dispersion(rows, base)),
                 "compare_noise.png": figure_bytes(plot_compare_noise(rows, base))}
    record = {"config": asdict(base), "wall_seconds": round(wall, 1), "summary": summary,
              "runs": [{"config": asdict(c), **r} for c, r, _ in done]}
    if chosen:
        record["chosen_lr"] = {", ".join(k): lr for k, lr in chosen.items()}
    written = write_outputs(out, files, f"{name}.json", record)
    print(f"wrote {', '.join(written)} | {wall:.0f}s")

# ----------------------------------------------------------------------------- alternatives
# python resharpen.py --alternatives: would another remedy do as well? (theory.md, Appendix E)


class LogLengthAttention(CausalSelfAttention):
    """--attn-scale logn (Scalable-Softmax, Nakanishi 2025): a query that sees n positions
    (itself and every earlier one, BOS included) has its scores multiplied by s_h log(n),
    with s_h a learned scale per head, initialized to 1:
        att = softmax(s_h log(n) q k^T / sqrt(head size))
    At n = 1 the one score becomes 0, which changes nothing: a single key has weight 1."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.log_scale = nn.Parameter(torch.ones(cfg.n_head))   # s_h

    def scores(self, q, k):
        n = torch.arange(1, q.shape[2] + 1, device=q.device, dtype=q.dtype)   # (T,)
        return super().scores(q, k) * (self.log_scale[:, None, None] * n.log()[:, None])


ATTENTIONS["logn"] = LogLengthAttention

ALTERNATIVES = {   # name: changes to the comparison's Pre-Norm setting
    "pre": {},
    "pre + dropout 0.1": dict(dropout=0.1),
    "pre + dropout 0.3": dict(dropout=0.3),
    "pre + log-length scaling": dict(attn_scale="logn"),
    "pre + BOS": dict(bos=True),
    "post": dict(norm="post"),
}


def alternative_runs(base, changes):
    sampled = dict(norm="pre", targets="sampled", lr_schedule="constant", ema=0.0, bema=False)
    return [replace(base, **{**sampled, **changes}, seed=base.seed + i)
            for i in range(COMPARE_SEEDS)]


def alternatives_table(named, train_len, v):
    """named: {name: [result of each seed]} -> markdown, raw and EMA weights."""
    head = ("| remedy | weight average | TVD, training lengths | TVD, extrapolation | "
            f"TVD at s = {v - 1} | gap x s, min - max over s (mean of seeds) |")
    out = [head, "|---" * 6 + "|"]
    for name, results in named.items():
        for avg in ("raw", "ema"):
            sums = [summarize(r[avg], train_len) for r in results]
            gap_s = [sum(r[avg]["logit_gap"][s - 1] for r in results) / len(results) * s
                     for s in range(1, v)]
            out.append(f"| {name} | {AVERAGE_LABELS[avg]} | "
                       + " | ".join(mean_sd([x[k] for x in sums])
                                    for k in ("tvd_train", "tvd_extrap", "tvd_last"))
                       + f" | {min(gap_s):.2f} - {max(gap_s):.2f} |")
    return "\n".join(out)


def plot_alternatives(named, cfg):
    """alternatives.png: TVD and gap x s against length per remedy (EMA weights)."""
    fig, (ax1, ax2) = new_figure(2)
    fig.set_size_inches(10.4, 4.6)
    s = list(range(1, cfg.vocab))
    colors = ["tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:gray", "tab:blue",
              "tab:cyan"]
    for i, ((name, results), color) in enumerate(zip(named.items(), colors)):
        top = dict(lw=3, zorder=5) if name.startswith("post") else dict(lw=1.5, zorder=3)
        top["ls"] = ("-", "--")[i % 2]   # dashed every other remedy: equal curves stay visible
        top["zorder"] += i % 2
        if name == "pre":                # wide and underneath: the remedies that change
            top.update(lw=4.5, zorder=1)  # nothing are drawn on top of it
        _band(ax1, s, [r["ema"]["tvd"] for r in results], name, color, **top)
        _band(ax2, s, [[g * x for x, g in zip(s, r["ema"]["logit_gap"])] for r in results],
              None, color, **top)
    for ax in (ax1, ax2):
        ax.axvspan(0.5, cfg.train_len + 0.5, color="0.9", zorder=0)
        ax.set(xlabel="prefix length s", xlim=(0.5, cfg.vocab - 0.5))
    ax1.set(ylabel="TVD to the exact target", ylim=(0, 1), title="the error, EMA weights")
    ax2.set(ylabel="logit gap x s", yscale="log",
            title="gap x s: flat = the 1/s law of dispersion")
    fig.legend(*ax1.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    return fig


def alternatives(base, out):
    """The remedies side by side, 3 seeds each; then Post-Norm with the best of the others,
    if one beats plain Pre-Norm. Writes alternatives.md, .json and .png."""
    names = list(ALTERNATIVES)
    runs = [cfg for name in names for cfg in alternative_runs(base, ALTERNATIVES[name])]
    done, wall, workers = run_grid(runs, pick_device(base.device), averages=("ema",))
    k = COMPARE_SEEDS   # run_grid returns the runs in grid order: k seeds per remedy
    named = {name: [r for _, r, _ in done[i * k:(i + 1) * k]] for i, name in enumerate(names)}
    extrap = {n: sum(summarize(r["ema"], base.train_len)["tvd_extrap"] for r in rs) / len(rs)
              for n, rs in named.items()}
    best = min((n for n in names if n not in ("pre", "post")), key=extrap.get)
    note = "No other remedy beat plain Pre-Norm beyond the training lengths (EMA weights)."
    if extrap[best] < extrap["pre"] - 0.005:   # helps: lower by more than rounding
        name = "post + " + best.split(" + ", 1)[1]
        changes = {**ALTERNATIVES[best], "norm": "post"}
        more, wall2, _ = run_grid(alternative_runs(base, changes), pick_device(base.device),
                                  averages=("ema",))
        named[name], wall = [r for _, r, _ in more], wall + wall2
        done += more
        note = f"The best of the others on Pre-Norm was '{best}'; '{name}' adds it to Post-Norm."
    table = alternatives_table(named, base.train_len, base.vocab)
    md = (f"Written by `python resharpen.py --alternatives` (v={base.vocab}, train lengths "
          f"1..{base.train_len}, {base.steps} steps, batch {base.batch_size}, lr {base.lr}, "
          f"sampled targets, constant learning rate).\n\n{table}\n\n{note} Mean +- standard "
          f"deviation over {COMPARE_SEEDS} seeds. {len(done)} training runs, {wall:.0f} s wall "
          f"in {workers} worker process(es).\n")
    print("\n" + md)
    files = {"alternatives.md": md.encode("utf-8"),
             "alternatives.png": figure_bytes(plot_alternatives(named, base))}
    record = {"config": asdict(base), "wall_seconds": round(wall, 1),
              "runs": [{"config": asdict(c), **r} for c, r, _ in done]}
    written = write_outputs(out, files, "alternatives.json", record)
    print(f"wrote {', '.join(written)} | {wall:.0f}s")

# ----------------------------------------------------------------------------- search
# python resharpen.py --search N: is the effect a property of the method or of the defaults?

SEARCH_N = 40            # the pre-registered size of the committed search (theory.md, App. F)
SEARCH_DEFAULT = 4       # a reader's quick version: 12 runs, a few minutes on 2 cores
SEARCH_ARMS = ("pre", "pre-final", "post")   # trained from the same seed: paired
SEARCH_THRESHOLDS = (0.05, 0.1, 0.2)         # training-length TVD, for the subgroups


def search_configs(n, seed, lrs=None):
    """n random configurations, each trained three times from the same seed, once per arm.
    With lrs (the tuned search): arms pre-final and post, each at every rate of lrs, drawn in
    the corner most favourable to post: batch 192..256, 4000..8000 steps.
    Ranges: vocabulary 16..64; longest training length v/4 .. (v-1)/2 (so that 2 L is a test
    length); 1..4 heads; width the smallest multiple of the heads >= 2v - 2 (theory.md,
    Appendix A); lr log-uniform 3e-4..1e-2; batch log-uniform 64..256; 1000..4000 steps;
    sampled targets, constant learning rate, no dropout."""
    g = random.Random(seed)
    configs = []
    for i in range(n):
        v = g.randint(16, 64)
        heads = g.randint(1, 4)
        base = Config(vocab=v, train_len=g.randint(math.ceil(v / 4), (v - 1) // 2),
                      n_head=heads, n_embd=heads * math.ceil((2 * v - 2) / heads),
                      lr=round(10 ** g.uniform(math.log10(3e-4), -2), 6),
                      batch_size=round(2 ** g.uniform(6, 8)), steps=g.randint(1000, 4000),
                      seed=seed + i)
        if lrs:
            base = replace(base, batch_size=g.randint(192, 256), steps=g.randint(4000, 8000))
            configs.append([replace(base, norm=arm, lr=lr) for arm in ("pre-final", "post")
                            for lr in lrs])
        else:
            configs.append([replace(base, norm=arm) for arm in SEARCH_ARMS])
    return configs


def search_arms(runs, results):
    """{arm: (config, result)}: with several rates per arm, the rate with the lowest
    training-length TVD (EMA weights)."""
    best = {}
    for c in runs:
        r = results[astuple(c)]
        t = summarize(r["ema"], c.train_len)["tvd_train"]
        if c.norm not in best or t < best[c.norm][0]:
            best[c.norm] = (t, c, r)
    return {arm: (c, r) for arm, (_, c, r) in best.items()}


def wilson(k, n, z=1.96):
    """95 % Wilson score interval of a proportion k / n."""
    p, d = k / n, 1 + z * z / n
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (p + z * z / (2 * n)) / d - half, (p + z * z / (2 * n)) / d + half


def sign_test(k, n):
    """Two-sided exact sign test: the chance of a split at least as uneven as k of n."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


def wilcoxon(diffs):
    """Two-sided exact Wilcoxon signed-rank test (zeros dropped, tied |d| share their mean
    rank): the distribution of the positive rank sum, counted over all 2^n sign patterns."""
    d = sorted((x for x in diffs if x != 0), key=abs)
    n = len(d)
    if n == 0:
        return 1.0
    ranks, i = [0] * n, 0   # twice the ranks, so that shared mean ranks stay integers
    while i < n:
        j = i
        while j + 1 < n and abs(d[j + 1]) == abs(d[i]):
            j += 1
        ranks[i:j + 1] = [i + j + 2] * (j - i + 1)
        i = j + 1
    counts = {0: 1}
    for r in ranks:
        new = dict(counts)
        for total, c in counts.items():
            new[total + r] = new.get(total + r, 0) + c
        counts = new
    w, mid = sum(r for r, x in zip(ranks, d) if x > 0), sum(ranks) / 2
    extreme = sum(c for total, c in counts.items() if abs(total - mid) >= abs(w - mid))
    return min(1.0, extreme / 2**n)


def bootstrap_median(xs, reps=10000, seed=0):
    """Median of xs and its 95 % percentile-bootstrap interval (fixed seed: reproducible)."""
    g = random.Random(seed)
    meds = sorted(statistics.median(g.choices(xs, k=len(xs))) for _ in range(reps))
    return statistics.median(xs), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def search_pairs(configs, results, rival, avg):
    """Per configuration: (log ratio rival / post of the TVD at 2 L, training TVD of the
    pair: the larger of the two), with the weights avg."""
    out = []
    for runs in configs:
        m = {arm: r[avg] for arm, (_, r) in search_arms(runs, results).items()}
        L = runs[0].train_len
        ratio = m[rival]["tvd"][2 * L - 1] / m["post"]["tvd"][2 * L - 1]
        train = max(summarize(m[k], L)["tvd_train"] for k in (rival, "post"))
        out.append((math.log(ratio), train))
    return out


def search_stats(pairs):
    """Win rate of post (log ratio > 0) with its interval, sign and Wilcoxon tests, median
    ratio with its bootstrap interval."""
    logs = [x for x, _ in pairs]
    n, k, ties = len(logs), sum(x > 0 for x in logs), sum(x == 0 for x in logs)
    if n == 0:
        return {"n": 0}
    med, lo, hi = bootstrap_median(logs)
    return {"n": n, "post_wins": k, "win_rate": k / n, "win_rate_95": wilson(k, n),
            "sign_p": sign_test(k, n - ties) if n > ties else 1.0, "wilcoxon_p": wilcoxon(logs),
            "median_ratio": math.exp(med), "median_ratio_95": (math.exp(lo), math.exp(hi))}


def search_summary(configs, results):
    """The primary endpoint and every secondary one: {rival: {avg: {subgroup: stats}}}."""
    out = {}
    for rival in (a for a in ("pre-final", "pre") if a in {c.norm for c in configs[0]}):
        for avg in ("ema", "raw"):
            pairs = search_pairs(configs, results, rival, avg)
            out.setdefault(rival, {})[avg] = {"all": search_stats(pairs), **{
                f"train TVD < {t}": search_stats([p for p in pairs if p[1] < t])
                for t in SEARCH_THRESHOLDS}}
    return out


def search_losses(configs, results):
    """Where post loses the primary endpoint: for each drawn setting, post's win rate in the
    configurations below and above its median."""
    logs = [x for x, _ in search_pairs(configs, results, "pre-final", "ema")]
    settings = {"v": lambda c: c.vocab, "L / v": lambda c: c.train_len / c.vocab,
                "heads": lambda c: c.n_head, "lr": lambda c: c.lr,
                "batch": lambda c: c.batch_size, "steps": lambda c: c.steps}
    rows = []
    for name, get in settings.items():
        xs = [get(search_arms(runs, results)["post"][0]) for runs in configs]
        cut = statistics.median(xs)
        low = [x > 0 for x, c in zip(logs, xs) if c <= cut]
        high = [x > 0 for x, c in zip(logs, xs) if c > cut]
        rate = lambda w: f"{sum(w)} of {len(w)}" if w else "-"
        rows.append(f"| {name} | {cut:.3g} | {rate(low)} | {rate(high)} |")
    return ["| setting | median | post wins, at or below | above |", "|---" * 4 + "|"] + rows


def plot_search(configs, results):
    """search.png: the paired ratio at 2 L against the pair's training TVD, per rival."""
    import matplotlib.ticker
    rivals = [a for a in ("pre-final", "pre") if a in {c.norm for c in configs[0]}]
    fig, axes = new_figure(len(rivals))
    for ax, rival in zip(axes if len(rivals) > 1 else [axes], rivals):
        for avg, style in (("ema", dict(color="tab:blue", label=f"EMA {COMPARE_EMA}")),
                           ("raw", dict(color="0.5", mfc="none", label="raw weights"))):
            pairs = search_pairs(configs, results, rival, avg)
            ax.plot([t for _, t in pairs], [math.exp(x) for x, _ in pairs], "o", ms=5, **style)
        ax.axhline(1, color="k", lw=1, ls="--")
        for t in SEARCH_THRESHOLDS:
            ax.axvline(t, color="0.7", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="training-length TVD (worse of the pair)",
               ylabel=f"TVD at 2 L: {rival} / post", title=f"above 1: post beats {rival}")
        for axis, ticks in ((ax.xaxis, (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)),
                            (ax.yaxis, (0.5, 1, 2, 5, 10))):   # plain numbers, no overlap
            lo, hi = axis.get_view_interval()
            shown = [t for t in ticks if lo <= t <= hi]
            axis.set_ticks(shown, labels=[f"{t:g}" for t in shown])
            axis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=8)
    return fig


def search(base, out, n, lrs=None, command=""):
    """python resharpen.py --search N: N random configurations, one run per arm each (with
    lrs: one per arm and rate, each arm at its best rate)."""
    configs = search_configs(n, base.seed, lrs)
    runs = [cfg for group in configs for cfg in group]
    done, wall, workers = run_grid(runs, pick_device(base.device), averages=("ema",))
    results = {astuple(c): r for c, r, _ in done}
    h = search_summary(configs, results)
    p = h["pre-final"]["ema"]["all"]
    fmt = lambda st: ("no configuration" if st["n"] == 0 else
                      f"{st['post_wins']} of {st['n']} ({st['win_rate_95'][0]:.2f} - "
                      f"{st['win_rate_95'][1]:.2f}) | {st['sign_p']:.3g} | "
                      f"{st['wilcoxon_p']:.3g} | {st['median_ratio']:.2f} "
                      f"({st['median_ratio_95'][0]:.2f} - {st['median_ratio_95'][1]:.2f})")
    lines = ["| rival | weights | configurations | post wins (95 % interval) | sign test p | "
             "Wilcoxon p | median ratio rival / post (95 % bootstrap) |", "|---" * 7 + "|"]
    for rival in h:
        for avg in ("ema", "raw"):
            for group, st in h[rival][avg].items():
                if st["n"]:
                    lines.append(f"| `{rival}` | {AVERAGE_LABELS[avg]} | {group} | {fmt(st)} |")
    tvd = lambda c, avg, s: results[astuple(c)][avg]["tvd"][s - 1]
    train = lambda c, avg: summarize(results[astuple(c)][avg], c.train_len)["tvd_train"]
    arms = list(search_arms(configs[0], results))
    rows = ["| # | v | L | heads | width | lr | batch | steps | " +
            " | ".join(f"{a}: train, 2 L" for a in arms) + " | post beats pre-final |",
            "|---" * (9 + len(arms)) + "|"]
    for i, runs in enumerate(configs):
        best = search_arms(runs, results)
        c, L = best["post"][0], runs[0].train_len
        cells = " | ".join(f"{train(r, 'ema'):.3f}, {tvd(r, 'ema', 2 * L):.3f}" +
                           (f" (lr {r.lr:g})" if lrs else "") for r, _ in best.values())
        win = tvd(best["pre-final"][0], "ema", 2 * L) > tvd(c, "ema", 2 * L)
        rows.append(f"| {i} | {c.vocab} | {L} | {c.n_head} | {c.n_embd} | "
                    f"{'tuned' if lrs else format(c.lr, '.2g')} | "
                    f"{c.batch_size} | {c.steps} | {cells} | {'yes' if win else 'no'} |")
    text = (f"Written by `{command or 'python resharpen.py --search ' + str(n)}` (seed {base.seed}; ranges in "
            "`search_configs`; protocol in theory.md, Appendix F).\n\n"
            f"Primary endpoint (EMA {COMPARE_EMA} weights, all {n} configurations): the TVD at "
            f"twice the longest training length was lower with `post` than with `pre-final` in "
            f"{fmt(p).split(' |')[0]}; two-sided sign test p = {p['sign_p']:.3g}, Wilcoxon "
            f"p = {p['wilcoxon_p']:.3g}; median ratio pre-final / post "
            f"{p['median_ratio']:.2f} (95 % bootstrap interval {p['median_ratio_95'][0]:.2f} - "
            f"{p['median_ratio_95'][1]:.2f}).\n\n"
            "### Every endpoint, overall and by training TVD\n\n" + "\n".join(lines) +
            "\n\n### Where post loses to pre-final (primary endpoint, split at each setting's "
            "median)\n\n" + "\n".join(search_losses(configs, results)) +
            "\n\n### Every configuration (EMA weights)\n\n" + "\n".join(rows) +
            f"\n\n{len(done)} training runs, {wall:.0f} s wall in {workers} worker process(es).\n")
    print("\n" + text)
    files = {"search.md": text.encode("utf-8"),
             "search.png": figure_bytes(plot_search(configs, results))}
    record = {"summary": h, "wall_seconds": round(wall, 1),
              "runs": [{"config": asdict(c), **r} for c, r, _ in done]}
    written = write_outputs(out, files, "search.json", record)
    print(f"wrote {', '.join(written)} | {wall:.0f}s")

# ----------------------------------------------------------------------------- language suite
# python resharpen.py --suite: do the remedies carry over? (README, "Formal languages")

SUITE_LANGUAGES = (dict(task="dyck", brackets=2, max_depth=4), dict(task="shuffle", brackets=2))
# Counting and matching brackets need more than a bag of tokens: two layers (the second
# reads what the first computed at every position), an MLP to read counts, and a BOS
# token, whose share of uniform attention, 1 / (t + 1), tells the model how long its
# prefix is (theory.md, Appendix D). Trained on lengths 1..16, tested to 64.
SUITE_MODEL = dict(train_len=16, n_layer=2, n_head=1, n_embd=32, mlp=True, bos=True,
                   dropout=0.0, steps=3000, batch_size=128, lr=1e-3, lr_schedule="constant",
                   targets="sampled")


SUITE_NORMS = ("pre", "pre-final", "post")
SUITE_SEEDS = 5
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306,
       10: 2.262}   # Student's t, two-sided 95 %, by the number of paired values (n - 1 df)


def suite_grid(base, **overrides):
    """Every language x SUITE_NORMS x SUITE_SEEDS seeds, with SUITE_MODEL's settings."""
    seeds = [base.seed + i for i in range(SUITE_SEEDS)]
    settings = {**SUITE_MODEL, **overrides, "ema": 0.0, "bema": False}
    return [language_config(base, **settings, **lang, norm=norm, seed=s)
            for lang in SUITE_LANGUAGES for norm in SUITE_NORMS for s in seeds]


def mean_interval(xs):
    """Mean of paired differences and its 95 % t interval (the seeds are the pairs)."""
    n, mean = len(xs), sum(xs) / len(xs)
    half = T95[n] * math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)
    return mean, mean - half, mean + half


def suite_pairs(done, L):
    """Per language, rival - post in mean extrapolation TVD (EMA weights), paired by seed."""
    out = ["| language | difference (EMA weights, extrapolation TVD) | per seed | mean (95 % t "
           "interval) | distinguishable from seed noise |", "|---" * 5 + "|"]
    for lang in SUITE_LANGUAGES:
        ext = {c.norm: {} for c, _, _ in done}
        for c, r, _ in done:
            if c.task == lang["task"]:
                ext[c.norm][c.seed] = summarize(r["ema"], L)["tvd_extrap"]
        name = make_task(language_config(**lang)).name
        for rival in (n for n in SUITE_NORMS if n != "post"):
            d = [ext[rival][k] - ext["post"][k] for k in sorted(ext["post"])]
            mean, lo, hi = mean_interval(d)
            out.append(f"| {name} | `{rival}` - `post` | " + ", ".join(f"{x:+.3f}" for x in d)
                       + f" | {mean:+.4f} ({lo:+.4f} to {hi:+.4f}) | "
                       + ("no" if lo <= 0 <= hi else "yes") + " |")
    return out


def suite_table(done, wall, workers):
    head = ("| language | norm | weight average | TVD, training lengths | TVD, extrapolation "
            "| TVD at the longest length | invalid mass, extrapolation |")
    out, L = [head, "|---" * 7 + "|"], done[0][0].train_len
    for lang in SUITE_LANGUAGES:
        for norm in SUITE_NORMS:
            runs = [(c, r) for c, r, _ in done if c.task == lang["task"] and c.norm == norm]
            name = make_task(runs[0][0]).name
            for avg in ("raw", "ema"):
                ms = [r[avg] for _, r in runs]
                sums = [summarize(m, L) for m in ms]
                inv = [sum(m["invalid_mass"][L:]) / len(m["invalid_mass"][L:]) for m in ms]
                out.append(f"| {name} | `{norm}` | {AVERAGE_LABELS[avg]} | "
                           f"{mean_sd([s['tvd_train'] for s in sums])} | "
                           f"{mean_sd([s['tvd_extrap'] for s in sums])} | "
                           f"{mean_sd([s['tvd_last'] for s in sums])} | {mean_sd(inv)} |")
    out += ["", f"Mean +- standard deviation over {SUITE_SEEDS} seeds.", "",
            "### Paired by seed: each placement minus `post` (positive: `post` is lower)", ""]
    out += suite_pairs(done, L)
    out += ["", f"{len(done)} training runs, {wall:.0f} s wall in {workers} worker process(es)."]
    return "\n".join(out)


def plot_suite(done):
    """suite.png: TVD against position per language, Pre-Norm and Post-Norm, raw and EMA."""
    fig, axes = new_figure(len(SUITE_LANGUAGES))
    for ax, lang in zip(axes, SUITE_LANGUAGES):
        cfg = next(c for c, _, _ in done if c.task == lang["task"])
        ax.axvspan(0.5, cfg.train_len + 0.5, color="0.9", label="training lengths")
        for norm in SUITE_NORMS:
            runs = [r for c, r, _ in done if c.task == lang["task"] and c.norm == norm]
            xs = runs[0]["raw"]["length"]
            ax.plot(xs, [sum(c) / len(c) for c in zip(*[r["raw"]["tvd"] for r in runs])],
                    "--", color=COLORS[norm], lw=1, label=f"{norm}, raw weights")
            _band(ax, xs, [r["ema"]["tvd"] for r in runs], f"{norm}, EMA {COMPARE_EMA}",
                  COLORS[norm], zorder=3 + (norm == "post"))
        ax.set(xlabel="position", ylabel="TVD to the exact next-token distribution",
               title=make_task(cfg).name, ylim=(0, None))
        ax.legend(fontsize=7, loc="upper left")
    return fig


def suite(base, out, **overrides):
    """python resharpen.py --suite: the languages, then suite.md, suite.json, suite.png."""
    done, wall, workers = run_grid(suite_grid(base, **overrides), pick_device(base.device))
    table = suite_table(done, wall, workers)
    print("\n" + table)
    settings = ", ".join(f"{k} {v}" for k, v in {**SUITE_MODEL, **overrides}.items())
    md = f"Written by `python resharpen.py --suite` ({settings}).\n\n{table}\n"
    files = {"suite.md": md.encode("utf-8"), "suite.png": figure_bytes(plot_suite(done))}
    record = {"wall_seconds": round(wall, 1),
              "runs": [{"config": asdict(c), **r} for c, r, _ in done]}
    written = write_outputs(out, files, "suite.json", record)
    print(f"wrote {', '.join(written)} | {wall:.0f}s")

# ----------------------------------------------------------------------------- theory
# python resharpen.py --theory: Part 1's hand-built models against their formulas

HAND_BUILT_NORMS = tuple(NORMS)


def predicted_margin(vocab, norm, s, gamma=1.0, eps=1e-5):
    """theory.md, sections 2 and 4 and Appendix C: unseen minus seen logit at length s for
    hand_built(vocab, norm, gamma). The values' average u_bar = 1_t / s - 1/v has seen-unseen
    difference 1/s; each LayerNorm divides it by the spread of what it sees."""
    n = 2 * vocab
    var_1 = (n - 1) / n**2 + eps   # the input LN (pre, pre-final) sees one token e_(v+x)
    if norm == "pre":
        return gamma / (s * math.sqrt(var_1))
    if norm == "pre-final":        # the final LN sees that token plus u_bar / sqrt(var_1)
        var_f = (1 + (1 / s - 1 / vocab) / var_1) / n - 1 / n**2
        return gamma / (s * math.sqrt(var_1) * math.sqrt(var_f + eps))
    var = {"post": (1 / s - 1 / vocab) / n,                          # u_bar alone: shrinks
           "post-residual": (1 + 1 / s - 1 / vocab) / n - 1 / n**2,  # token + u_bar
           }[norm]
    return gamma / (s * math.sqrt(var + eps))


def predicted_tvd(vocab, s, margin):
    """theory.md's TVD of balanced logits with margin m, s / (s + (v - s) e^m), written so
    that a large margin cannot overflow."""
    return 1 / (1 + (vocab - s) / s * math.exp(min(margin, 700)))


def fit_lengths_1_2(vocab, n_embd, head_dim, steps=1500, seed=0):
    """theory.md, Appendix A: fit the minimal model f(t) = B[t_s] + mean_i D[t_i] (uniform
    attention, no norm), with B = E U and D = E W_V W_O U of the given widths, to balanced
    logits at lengths 1 and 2 with m_1 = 2, m_2 = 1: -2 e_x for (x), -(e_x + e_y) for
    (x, y), each up to a constant. Returns the root-mean-square residual (Adam, cosine
    decay). It assumes the even split and m_1 = 2 m_2, so it cannot test Step 2 itself."""
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
    """The hand-built models against their formulas, each scaled so that its margin at the
    longest training length is 6; writes theory.png."""
    rows = {}
    for norm in HAND_BUILT_NORMS:
        gamma = 6.0 / predicted_margin(vocab, norm, train_len)
        m = evaluate(hand_built(vocab, norm, gamma), n_perm=200)
        pred_m = [predicted_margin(vocab, norm, s, gamma) for s in m["length"]]
        pred_tvd = [predicted_tvd(vocab, s, pm) for s, pm in zip(m["length"], pred_m)]
        rows[norm] = (m, pred_m, pred_tvd)
    print(f"hand-built models, v={vocab}, each scaled to margin 6 at s={train_len}; "
          "'model' is evaluate() on the script's own Transformer, in float64\n(a TVD below "
          "about 1e-15 is float64 rounding, not the model)")
    for norm, (m, pred_m, pred_tvd) in rows.items():
        print(f"\n{norm}: {NORMS[norm]}\n{'s':>4} {'margin: formula':>16} {'model':>10} "
              f"{'TVD: formula':>14} {'model':>10}")
        for s in sorted({1, 2, 4, train_len, 2 * train_len, vocab - 1} & set(m["length"])):
            i = s - 1
            print(f"{s:>4} {pred_m[i]:16.5f} {m['logit_gap'][i]:10.5f} {pred_tvd[i]:14.3e} "
                  f"{m['tvd'][i]:10.3e}")
    fig, (ax1, ax2) = new_figure(2)
    fig.set_size_inches(10.4, 4.4)
    for norm, (m, pred_m, pred_tvd) in rows.items():
        c = COLORS[norm]
        ax1.plot(m["length"], pred_m, color=c, lw=1.5, label=f"{norm}: formula")
        ax1.plot(m["length"], m["logit_gap"], "o", color=c, ms=3, label=f"{norm}: model")
        ax2.semilogy(m["length"], pred_tvd, color=c, lw=1.5)
        ax2.semilogy(m["length"], [max(t, 1e-12) for t in m["tvd"]], "o", color=c, ms=3)
    for ax in (ax1, ax2):
        ax.axvspan(0.5, train_len + 0.5, color="0.9")
        ax.set_xlabel("prefix length s")
    ax1.set(ylabel="margin: unseen minus seen logit",
            title="hand-built margins (theory.md 2, 4, App. C)")
    ax2.set(ylabel="TVD (equal to the invalid mass)", title="hand-built TVD", ylim=(1e-9, 1.5))
    fig.legend(*ax1.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(f"hand-built models, v = {vocab}: each readout scale gamma chosen so that the "
                 f"margin is 6 at s = {train_len} (the longest training length)", fontsize=10)
    written = write_outputs(out, {"theory.png": figure_bytes(fig)})
    print(f"\nwrote {', '.join(written)}")

# ----------------------------------------------------------------------------- hand-out
# python resharpen.py --handout: the exercises for a class, without the answers


def handout(out):
    """Write the README's Exercises section alone to OUT/exercises.md: no Answers section, no
    paragraph for the teacher (those start with '*For the teacher'), no links into the README."""
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Exercises\n", 1)[1].split("\n## Answers", 1)[0]
    kept = [p for p in section.split("\n\n") if not p.lstrip().startswith("*For the teacher")]
    body = "\n\n".join(kept).strip()
    body = re.sub(r"\[([^\]]+)\]\(#[^)]*\)", r"\1", body)   # [text](#anchor) -> text
    md = f"# Exercises: Post-Norm can Resharpen Attention (resharpen.py)\n\n{body}\n"
    written = write_outputs(out, {"exercises.md": md.encode("utf-8")})
    print(f"wrote {', '.join(written)}: the exercises without the answers")

# ----------------------------------------------------------------------------- command line

LIMITS = {"vocab": 1024, "train_len": 1024, "brackets": 16, "max_depth": 64, "n_layer": 16,
          "n_head": 64, "n_embd": 2048, "batch_size": 8192, "steps": 10**7}
LANGUAGE_TRAIN_LEN = 256          # a language is evaluated on 4 x train_len positions
MEMORY_LIMIT = 8 * 2**30          # bytes a run may hold at its peak (run_memory's estimate)
CPU_FLOPS = 2e10                  # float32 operations a second, a laptop CPU, for run_seconds
THEORY_VOCAB = 256                # --theory's float64 models of width 2v: a minute at most
SEED_LIMIT = 2**32 - COMPARE_SEEDS   # seeds are 0 .. this; the grids use seed .. seed + 2


def eval_len(cfg):
    """Positions evaluate() runs, as the task's own evaluation inputs say (BOS included)."""
    return make_task(cfg).eval_inputs(1).shape[1] + cfg.bos


def parameter_count(cfg):
    C = cfg.n_embd
    return cfg.n_layer * (4 + 8 * cfg.mlp) * C * C + (2 * cfg.vocab + cfg.bos) * C


def run_memory(cfg):
    """A generous estimate, in bytes, of a run's peak: the interpreter and libraries (512
    MiB), 12 float32 copies of the weights (weights, gradients, Adam's two moments, up to
    three for an average, the averaged copy that is evaluated, a checkpoint's bytes), one
    training step's activations and attention weights with their gradients, and one chunk
    of the evaluation (about 32 bytes per number: float32 and float64 copies)."""
    T = cfg.train_len + cfg.bos
    per_layer = 4 * cfg.n_head * T + 16 * cfg.n_embd * (1 + 2 * cfg.mlp)
    step = 4 * cfg.batch_size * T * (cfg.n_layer * per_layer + 4 * cfg.vocab)
    chunk = 32 * max(EVAL_CHUNK, numbers_per_input(cfg, eval_len(cfg)))
    return 2**29 + 48 * parameter_count(cfg) + step + chunk


def run_seconds(cfg):
    """A rough estimate of (seconds per training step, seconds in all) on a CPU: matrix
    products only, forward and backward, at CPU_FLOPS."""
    T, n = cfg.train_len + cfg.bos, eval_len(cfg)
    matmul = cfg.n_layer * (4 + 8 * cfg.mlp) * cfg.n_embd**2 + cfg.vocab * cfg.n_embd
    attn = lambda t: 4 * t * t * cfg.n_embd * cfg.n_layer
    step = 3 * cfg.batch_size * (2 * T * matmul + attn(T)) / CPU_FLOPS
    evaluation = 3 * EVAL_PERMS * (2 * n * matmul + attn(n)) / CPU_FLOPS   # raw + 2 averages
    return step, cfg.steps * step + evaluation


def planned_runs(args, cfg, given):
    """Every configuration the command will train, so that each is checked before the first."""
    if args.theory or args.handout:
        return []
    if args.compare or args.long:
        base = replace(cfg, **LONG_MODEL) if args.long else cfg
        return compare_grid(base, *((LONG_NORMS, LONG_REGIMES) if args.long else ()))
    if args.suite:
        return suite_grid(cfg, **{k: getattr(args, k) for k in given & set(SUITE_MODEL)})
    if args.alternatives:   # the second stage adds a remedy to post: the same sizes
        return [c for ch in ALTERNATIVES.values() for c in alternative_runs(cfg, ch)]
    if args.search is not None:
        return [c for group in search_configs(args.search, cfg.seed) for c in group]
    return [cfg]


NAME_MAX = 255 - 24   # a file's temporary name is its own plus up to 24 characters


def path_problem(path, folder):
    """Why path could not be written as a folder (folder=True) or a file, or None. Nothing
    is created or changed."""
    if not path:
        return "is empty"
    for part in os.path.abspath(path).split(os.sep):
        if len(os.fsencode(part)) > NAME_MAX:
            return f"has a name longer than {NAME_MAX} bytes"
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    if os.path.islink(p) and not os.path.exists(p):
        return f"{p} is a broken or looping symbolic link"
    if p == os.path.abspath(path):          # it exists
        if folder and not os.path.isdir(p):
            return "is not a folder"
        if not folder and os.path.isdir(p):
            return "is a folder; give a file name, such as runs/model.pt"
        p = p if folder else os.path.dirname(p)
    if not os.path.isdir(p):
        return f"{p} is not a folder"
    if not os.access(p, os.R_OK | os.W_OK | os.X_OK):
        return f"the folder {p} cannot be read and written"
    return None


MODE_FILES = {"theory": ["theory.png"], "handout": ["exercises.md"],
              "compare": ["compare.md", "compare.json", "compare_regimes.png",
                          "compare_norms.png", "compare_dispersion.png", "compare_noise.png"],
              "long": ["long.md", "long.json", "long.png"],
              "suite": ["suite.md", "suite.json", "suite.png"],
              "alternatives": ["alternatives.md", "alternatives.json", "alternatives.png"],
              "search": ["search.md", "search.json", "search.png"]}


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line naming what is wrong, exit code 2: no usage dump, no traceback."""
        message = message.replace("\n", "\\n").replace("\r", "\\r")
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def rates(text):
    xs = [float(x) for x in text.split(",")]
    if not all(0 < x < 1 for x in xs):
        raise ValueError(text)
    return xs


def norm_list(text):
    xs = tuple(text.split(","))
    if not set(xs) <= set(NORMS) or len(set(xs)) < len(xs):
        raise argparse.ArgumentTypeError(f"each of {', '.join(NORMS)} at most once, got {text}")
    return xs


def regime_list(text):
    xs = tuple(tuple(x.split("/")) for x in text.split(","))
    if not set(xs) <= set(REGIMES) or len(set(xs)) < len(xs):
        raise argparse.ArgumentTypeError(
            f"each of {', '.join('/'.join(r) for r in REGIMES)} at most once, got {text}")
    return xs


def build_parser():
    d = Config()
    p = Parser(prog="resharpen.py", formatter_class=HelpFormatter, allow_abbrev=False,
               description="Train a tiny transformer on short inputs of the Set Complement "
                           "task (or a formal language),\nevaluate it at every length, print "
                           "a table, write figures and metrics.json.",
               epilog="where the LayerNorm sits (--norm):\n" +
               "\n".join(f"  {k:14s} {v}" for k, v in NORMS.items()) +
               "\n\nsizes accepted (larger ones are refused before training):\n  " +
               ", ".join(f"--{k.replace('_', '-')} <= {v}" for k, v in list(LIMITS.items())[:5])
               + ",\n  " + ", ".join(f"--{k.replace('_', '-')} <= {v}"
                                      for k, v in list(LIMITS.items())[5:]) +
               f",\n  --train-len <= {LANGUAGE_TRAIN_LEN} for a language; and a run whose "
               f"estimated peak memory is over {MEMORY_LIMIT // 2**30} GiB is refused\n\n"
               "threads: torch uses one per core. On Linux, idle threads spin only briefly "
               "(GOMP_SPINCOUNT=1000),\nso that two runs at once share the cores well; set "
               "OMP_NUM_THREADS=1 (or GOMP_SPINCOUNT) to override.")
    a = p.add_argument
    a("--task", choices=["complement", "dyck", "shuffle"], default=d.task,
      help="Set Complement, or a formal language: Dyck-(k, D) or Shuffle-k")
    a("--vocab", type=int, default=d.vocab,
      help="vocabulary size v, 3 or more (Set Complement; a language has 2k + 1)")
    a("--train-len", type=int, default=d.train_len,
      help="train on prefix lengths 1 .. this (at most v - 1)")
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
    a("--dropout", type=float, default=d.dropout,
      help="dropout probability, on the attention weights and on each block's outputs")
    a("--attn-scale", choices=list(ATTENTIONS), default=d.attn_scale,
      help="logn: multiply a query's scores by s_h log(n), n the positions it sees (BOS "
           "included), s_h learned per head (Scalable-Softmax)")
    a("--steps", type=int, default=d.steps, help="optimizer steps")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    a("--lr", type=float, default=d.lr, help="AdamW learning rate")
    a("--lr-schedule", choices=["constant", "cosine"], default=d.lr_schedule,
      help="constant, or a cosine decay to zero over --steps")
    a("--ema", type=float, default=d.ema, help="EMA decay of the weights, in [0, 1); 0 = off")
    a("--bema", action="store_true",
      help="average with BEMA (bias-corrected EMA, kappa 0.5, eta 0.2, rho 10) instead")
    a("--seed", type=int, default=d.seed,
      help=f"seed of the initialization and training data, 0 .. {SEED_LIMIT}")
    a("--device", choices=["auto", "cpu", "cuda", "mps"], default=d.device,
      help="auto: cuda, then mps, then cpu")
    a("--out", default="runs", help="folder for the figures and the JSON record (the README's "
      "figures are regenerated with --out plots)")
    a("--save", metavar="PATH", help="write a checkpoint (config, raw and EMA weights) here")
    a("--lrs", type=rates, metavar="LR,LR,...",
      help="--compare, --long, --search: train each placement at every rate; each keeps the "
           "rate with the lowest training-length TVD (EMA weights) on the first seed")
    a("--norms", type=norm_list, metavar="NORM,...",
      help="--compare, --long: only these placements")
    a("--regimes", type=regime_list, metavar="TARGETS/SCHEDULE,...",
      help="--compare, --long: only these regimes, such as sampled/constant,exact/cosine")
    mode = p.add_mutually_exclusive_group()   # instead of one training run:
    a = mode.add_argument
    a("--theory", action="store_true",
      help="build theory.md's models by hand, compare them with the formulas, write "
           "theory.png (uses only --vocab, --train-len, --out)")
    a("--suite", action="store_true",
      help="run the formal-language suite (Dyck-(2, 4), Shuffle-2; pre and post norm; "
           f"{COMPARE_SEEDS} seeds from --seed) with its own settings, " +
           ", ".join(f"{k} {v}" for k, v in SUITE_MODEL.items()) + " (flags given for "
           "them override them), and write suite.md and suite.png")
    a("--compare", action="store_true",
      help="run the comparison grid instead (norms x averaging x targets x schedule, "
           f"{COMPARE_SEEDS} seeds from --seed) and write compare.md and compare_*.png")
    a("--long", action="store_true",
      help="the longer extrapolation: " + ", ".join(f"{k} {v}" for k, v in LONG_MODEL.items())
      + f", placements {', '.join(LONG_NORMS)}, sampled/constant and exact/cosine, "
      f"{COMPARE_SEEDS} seeds; write long.md, long.json and long.png")
    a("--handout", action="store_true",
      help="write the README's exercises without their answers to OUT/exercises.md, for a class")
    a("--alternatives", action="store_true",
      help="Pre-Norm with dropout, log-length scaling or BOS against Post-Norm, "
           f"{COMPARE_SEEDS} seeds from --seed; write alternatives.md and .png")
    a("--search", type=int, nargs="?", const=SEARCH_DEFAULT, metavar="N",
      help=f"paired random search: N configurations (default {SEARCH_DEFAULT}; the committed "
           f"one has {SEARCH_N}), each trained as pre, pre-final and post from --seed; write "
           "search.md, search.json and search.png")
    return p


def given_flags(parser, argv):
    """The destinations of the flags that argv names (as opposed to defaults)."""
    return {action.dest for action in parser._actions for tok in argv
            for opt in action.option_strings if tok == opt or tok.startswith(opt + "=")}


def check_args(args, parser, given, argv=()):
    """Reject bad input up front, before any training time is spent: everything accepted
    here runs to the end."""
    bad = parser.error
    flags = lambda dests: ", ".join(sorted(f"--{d.replace('_', '-')}" for d in dests))
    language = args.task != "complement"
    grid = (args.theory or args.compare or args.long or args.suite or args.alternatives
            or args.search or args.handout)
    if args.save is not None and grid:
        bad("--save: only a single training run writes a checkpoint (not --theory, --compare, "
            "--long, --suite, --alternatives, --search or --handout)")
    if "norm" in given and sum(t == "--post-norm" for t in argv) and sum(
            t == "--norm" or t.startswith("--norm=") for t in argv):
        bad("--post-norm: it means --norm post; give one of the two")
    if args.bema and "ema" in given:
        bad("--bema: it replaces the EMA; give --ema or --bema, not both")
    fixed = {"norm", "targets", "lr_schedule", "ema", "bema", "dropout", "attn_scale", "bos"}
    if args.alternatives and given & fixed:
        bad(f"{flags(given & fixed)}: --alternatives sets it itself")
    if args.search is not None and given - {"search", "seed", "device", "out", "lrs"}:
        bad(f"{flags(given - {'search', 'seed', 'device', 'out', 'lrs'})}: --search draws every "
            "setting itself (it accepts --seed, --device, --out and --lrs)")
    if not (args.compare or args.long) and given & {"norms", "regimes"}:
        bad(f"{flags(given & {'norms', 'regimes'})}: only for --compare and --long")
    if not (args.compare or args.long or args.search) and "lrs" in given:
        bad("--lrs: only for --compare, --long and --search")
    if args.search is not None and not 1 <= args.search <= 100:
        bad(f"--search must be a number of configurations in 1 .. 100, got {args.search}")
    if args.handout and given - {"handout", "out"}:
        bad(f"{flags(given - {'handout', 'out'})}: --handout takes only --out")
    if args.theory and args.vocab > THEORY_VOCAB:
        bad(f"--vocab {args.vocab}: --theory evaluates float64 models of width 2v, at most "
            f"--vocab {THEORY_VOCAB}")
    if args.theory and given - {"theory", "vocab", "train_len", "out"}:
        bad(f"{flags(given - {'theory', 'vocab', 'train_len', 'out'})}: --theory uses only "
            "--vocab, --train-len and --out")
    if (args.compare or args.long) and given & {"norm", "targets", "lr_schedule", "ema", "bema"}:
        bad(f"{flags(given & {'norm', 'targets', 'lr_schedule', 'ema', 'bema'})}: --compare "
            "and --long run every norm, target, schedule and average themselves")
    if args.long and given & set(LONG_MODEL):
        bad(f"{flags(given & set(LONG_MODEL))}: --long sets it itself ({LONG_MODEL})")
    if args.suite and given - set(SUITE_MODEL) - {"suite", "seed", "device", "out"}:
        bad(f"{flags(given - set(SUITE_MODEL) - {'suite', 'seed', 'device', 'out'})}: --suite "
            "sets it itself (it accepts --seed, --device, --out and SUITE_MODEL's flags)")
    if (args.compare or args.long or args.theory or args.alternatives or args.search) and language:
        bad(f"--task {args.task}: --compare, --long, --theory, --alternatives and --search use the "
            "Set Complement task only")
    if language and "vocab" in given:
        bad("--vocab: a language's vocabulary is 2 x --brackets + 1; leave --vocab out")
    if not language and given & {"brackets", "max_depth"}:
        bad(f"{flags(given & {'brackets', 'max_depth'})}: only for --task dyck or shuffle")
    if args.task == "shuffle" and "max_depth" in given:
        bad("--max-depth: only for --task dyck")
    for name, top in LIMITS.items():
        if not 1 <= getattr(args, name) <= top:
            bad(f"--{name.replace('_', '-')} must be an integer in 1 .. {top}, "
                f"got {getattr(args, name)}")
    if not language and args.vocab < 3:
        bad(f"--vocab must be at least 3, got {args.vocab}")
    top = args.vocab - 1 if not language else LANGUAGE_TRAIN_LEN
    if not args.suite and args.train_len > top:
        bad(f"--train-len must be in 1 .. {top}" + (" (vocab - 1)" if not language else "") +
            f", got {args.train_len}")
    if args.compare and 2 * args.train_len > args.vocab - 1:
        bad(f"--train-len: --compare reports the TVD at twice the training length, so at most "
            f"(vocab - 1) / 2 = {(args.vocab - 1) // 2}; got {args.train_len}")
    if args.alternatives and args.train_len > args.vocab - 2:
        bad(f"--train-len: --compare and --alternatives need lengths beyond training, so at "
            f"most vocab - 2 = {args.vocab - 2}; got {args.train_len}")
    if not 0 <= args.ema < 1:
        bad(f"--ema must be in [0, 1), got {args.ema}")
    if not 0 <= args.dropout < 1:
        bad(f"--dropout must be in [0, 1), got {args.dropout}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        bad(f"--lr must be a positive number, got {args.lr}")
    if not 0 <= args.seed <= SEED_LIMIT:
        bad(f"--seed must be in 0 .. {SEED_LIMIT}, got {args.seed}")
    present = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not present.get(args.device, True):
        allowed = ", ".join(["auto", "cpu"] + [d for d, ok in present.items() if ok])
        bad(f"--device {args.device}: no {args.device.upper()} device here; allowed: {allowed}")
    problem = path_problem(args.out, folder=True)
    if problem:
        bad(f"--out {args.out!r}: {problem}")
    mode = next((m for m in MODE_FILES if getattr(args, m, None) not in (None, False)), None)
    names = MODE_FILES[mode] if mode else ["metrics.json", "length.png", "loss.png"]
    for name in names:
        if os.path.isdir(os.path.join(args.out, name)):
            bad(f"--out {args.out!r}: {name} there is a folder, and this run writes a file there")
    if args.save is not None:
        save, out = args.save, os.path.realpath(args.out)
        folder = os.path.dirname(os.path.realpath(save)) if save else ""
        if save.endswith(("/", os.sep)) or os.path.realpath(save) == out:
            bad(f"--save {save!r}: give a file name, such as runs/model.pt")
        # The run creates --out, so a checkpoint may go into it even when it is new.
        problem = path_problem(save, folder=False) if folder != out else None
        if not problem and folder != out and not os.path.isdir(folder):
            problem = f"its folder {folder!r} does not exist"
        if os.path.lexists(save) and not os.path.isfile(save):
            problem = problem or "exists and is not a regular file"
        if (out + os.sep).startswith(os.path.realpath(save) + os.sep):
            problem = problem or "is a folder that --out needs"
        if problem:
            bad(f"--save {save!r}: {problem}")
        if os.path.realpath(save) in {os.path.join(out, f) for f in names}:
            bad(f"--save {save!r}: that is one of the run's own outputs in --out {args.out!r}")
    cfg = Config(**{k: getattr(args, k) for k in Config.__dataclass_fields__})
    cfg = language_config(cfg) if language else cfg
    runs = planned_runs(args, cfg, given)
    for run in runs:
        if run.n_embd % run.n_head:
            bad(f"--n-head {run.n_head}: the width (--n-embd, {run.n_embd} here) must be "
                "divisible by it")
        if run.task != "complement" and run.train_len > LANGUAGE_TRAIN_LEN:
            bad(f"--train-len {run.train_len}: a language trains on at most "
                f"{LANGUAGE_TRAIN_LEN} positions")
        if run_memory(run) > MEMORY_LIMIT:
            bad(f"--batch-size {run.batch_size}: a run would need about "
                f"{run_memory(run) / 2**30:.0f} GiB at its peak (limit "
                f"{MEMORY_LIMIT // 2**30} GiB); use a smaller --batch-size, --n-embd, --n-layer, "
                "--n-head, --train-len or --vocab")
    if runs and pick_device(args.device) == "cpu":
        per_step = max(run_seconds(r)[0] for r in runs)
        total = sum(run_seconds(r)[1] for r in runs) / (usable_cores() if len(runs) > 1 else 1)
        if per_step > 60 or total > 3600:
            print(f"resharpen.py: note: a rough estimate for this CPU is {per_step:.0f} s per "
                  f"step, {total / 3600:.1f} hours in all; Ctrl-C stops it", file=sys.stderr)


def stop(message, code):
    message = message.replace("\n", "\\n").replace("\r", "\\r")   # one line, whatever a path holds
    print(f"resharpen.py: {message}", file=sys.stderr)
    sys.exit(code)


STOP_SIGNALS = {getattr(signal, name): name for name in ("SIGINT", "SIGTERM", "SIGHUP")
                if hasattr(signal, name)}


def ignore_stop_signals():
    for sig in STOP_SIGNALS:
        with contextlib.suppress(OSError, ValueError):   # several signals at once
            signal.signal(sig, signal.SIG_IGN)


def on_stop_signal(signum, frame):
    """Ctrl-C, SIGTERM (a scheduler, kill) and SIGHUP (a closed terminal) stop the run alike:
    later signals are ignored while it cleans up; main() prints one line."""
    ignore_stop_signals()
    raise Interrupted(signum)


def main(argv=None):
    """The command line. Exit status: 0 done, 1 stopped (NaN, disk, memory), 2 bad input,
    128 + the signal's number when a signal stopped it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    for stream in (sys.stdout, sys.stderr):   # a path no console can encode prints as \xNN
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop_signal)
    try:
        run_main(argv)
    except (Interrupted, KeyboardInterrupt) as e:   # also while parsing and checking
        ignore_stop_signals()                         # exiting: later signals change nothing
        signum = getattr(e, "signum", signal.SIGINT)
        name = "Ctrl-C" if signum == signal.SIGINT else STOP_SIGNALS.get(signum, str(signum))
        written = getattr(e, "written", None)
        stop(f"interrupted ({name}) while writing; written: {', '.join(written)}; the JSON "
             "record was not, so that set is incomplete" if written else
             f"interrupted ({name}); nothing was written", 128 + int(signum))
    for sig, handler in previous.items():   # called from Python (tests): as it was
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def run_main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ["MPLBACKEND"] = "agg"   # figures are drawn off screen; a bad value fails late
    parser = build_parser()
    args = parser.parse_args(argv)
    given = given_flags(parser, argv)
    check_args(args, parser, given, argv)
    shown, skip = [], False   # the command, for the tables: every flag but --out and --device
    for tok in argv:
        if skip or tok.split("=")[0] in ("--out", "--device"):
            skip = not skip and "=" not in tok
            continue
        shown.append(tok)
    command = " ".join(["python resharpen.py"] + shown) if given & {"lrs", "norms", "regimes"} or (
        given & {"n_layer", "mlp"}) else ""
    cfg = Config(**{k: getattr(args, k) for k in Config.__dataclass_fields__})
    cfg = language_config(cfg) if cfg.task != "complement" else cfg
    oom = (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))
    try:
        import matplotlib.backends.backend_agg  # noqa: F401  (fail now, not after training)
    except ImportError:
        stop("matplotlib is missing: pip install -r requirements.txt", 2)
    try:
        if args.handout:
            handout(args.out)
        elif args.theory:
            theory(cfg.vocab, cfg.train_len, args.out)
        elif args.compare or args.long:
            compare(cfg, args.out, long=args.long, norms=args.norms, regimes=args.regimes,
                    lrs=args.lrs, command=command)
        elif args.suite:
            suite(cfg, args.out, **{k: getattr(args, k) for k in given & set(SUITE_MODEL)})
        elif args.alternatives:
            alternatives(cfg, args.out)
        elif args.search is not None:
            search(cfg, args.out, args.search, args.lrs, command)
        else:
            run_one(cfg, args.out, args.save)
    except FloatingPointError as e:
        stop(f"stopped: {e}; try a smaller --lr. Nothing was written.", 1)
    except WriteError as e:
        stop(str(e), 1)
    except oom:
        stop("out of memory; try a smaller --batch-size, --vocab or --n-embd. Nothing was "
             "written.", 1)
    except RuntimeError as e:
        if "overflow" in str(e).lower():   # an --lr beyond float32 (about 3e38)
            stop(f"stopped: {str(e).splitlines()[0][:80]}; try a smaller --lr. Nothing was "
                 "written.", 1)
        if "alloc" not in str(e).lower() and "out of memory" not in str(e).lower():
            raise
        stop(f"out of memory ({str(e).splitlines()[0][:80]}); try a smaller --batch-size, "
             "--vocab or --n-embd. Nothing was written.", 1)


if __name__ == "__main__":
    try:
        main()
        if sys.stdout is not None:   # None: started with its output closed (>&-)
            sys.stdout.flush()
    except BrokenPipeError:   # the output was piped into a program that stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except OSError as e:      # the output is full (/dev/full), a size limit (ulimit -f) ...
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"resharpen.py: stopped: {e}\n")
        os._exit(1)
