"""resharpen.py: "Post-Norm can Resharpen Attention" (Zsamboki et al., arXiv 2510.08341).

Predict the uniform distribution over the vocabulary tokens NOT in the input. A transformer
with no positions runs at any length, but its attention spreads as the input grows and its
prediction blurs; a LayerNorm that sees the attention average resharpens it.

A reading map. Part 1, the paper, top to bottom: config -> task -> model -> EMA -> training ->
evaluation -> theory.md's laws and its construction by hand. Part 2, what a single run calls:
its printed table, its figures and metrics.json, checkpoints, the command line, main last.
The experiments of the lab notebook (grids, statistics, the formal languages, BEMA) live in
plots/lab.py, which imports this file and plugs in through a task object, the ATTENTIONS
table and train()'s `averagers`.
    python resharpen.py --post-norm --ema 0.999   # the remedy, about a minute on one CPU thread
    python resharpen.py --help                    # every flag
"""

import argparse
import copy
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__":   # before torch loads: one thread per run (README, "Threads")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

# ======================================== Part 1: the paper on Set Complement (every default here)


@dataclass(frozen=True)   # a value: change it with replace(cfg, field=...)
class Config:
    vocab: int = 32           # v: tokens are 0 .. v-1
    train_len: int = 12       # train on prefixes of length s = 1 .. train_len
    targets: str = "sampled"  # 'sampled': one next token per position; 'exact': the target
    norm: str = "pre"         # where the LayerNorm sits: see NORMS
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 64
    mlp: bool = False         # attention only by default, like the paper's minimal model
    mlp_norm: bool = True     # the block's own MLP norm, ln_2 (False: --no-mlp-norm, an ablation)
    steps: int = 4000
    batch_size: int = 256
    lr: float = 3e-3          # constant by default: the regime where gradient noise shows
    lr_schedule: str = "constant"  # or 'cosine': decay to zero over the run
    ema: float = 0.0          # decay of the weight EMA; 0 = off
    seed: int = 0
    device: str = "auto"
    task: str = "complement"  # or a formal language: 'dyck', 'shuffle'
    brackets: int = 2         # k, for the formal languages
    max_depth: int = 4        # D, for Dyck-(k, D)
    bos: bool = False         # prepend a beginning-of-sequence token (a possible sink)
    dropout: float = 0.0      # on the attention weights and on each block's outputs
    attn_scale: str = "none"  # a key of ATTENTIONS; plots/lab.py adds 'logn'


NORMS = {
    "pre": "x + Attn(LN(x)), no final norm: logits read the raw residual stream",
    "pre-final": "x + Attn(LN(x)), then LN before the unembedding (GPT-2)",
    "post": "x + LN(Attn(x)): the norm on the attention output (resharpens)",
    "post-residual": "LN(x + Attn(x)): Vaswani et al. 2017, the norm after the residual sum",
}
EVAL_SEED = 1234    # the evaluation inputs never change with --seed or the model
EVAL_PERMS = 1000   # evaluation sample size
EVAL_CHUNK = 2**22  # evaluate about this many numbers at a time, so memory stays bounded


# ----------------------------------------------------------- the task (theory.md, section 1)
class SetComplement:
    """The task as an object with four methods. plots/lab.py's formal languages have the same
    four, so training and evaluation never ask which task they run."""
    name = "Set Complement"

    def __init__(self, cfg):
        self.vocab = cfg.vocab
        self.train_len = cfg.train_len

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

    def scores(self, q, k):   # q k^T / sqrt(head size); the lab's LogLengthAttention rescales them
        return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


ATTENTIONS = {"none": CausalSelfAttention}   # plots/lab.py adds 'logn'


class Block(nn.Module):
    """One transformer block; cfg.norm says where its LayerNorms sit (theory.md, section 4).
    Dropout (cfg.dropout) acts on the attention weights and on Attn's and MLP's outputs."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = cfg.norm
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = ATTENTIONS[cfg.attn_scale](cfg)
        C = cfg.n_embd
        self.ln_2 = (nn.LayerNorm(C) if cfg.mlp_norm else nn.Identity()) if cfg.mlp else None
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
            a, att = self.attn(x)
            # Exercise 2: the norm gives the attention output unit spread over the features
            # however many tokens it averaged: this is what resharpens (theory.md, section 4).
            x = x + self.ln_1(self.drop(a))
            if self.mlp:
                x = x + self.ln_2(self.drop(self.mlp(x)))
            # end of Exercise 2
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
            logits = logits[:, 1:]
            atts = [a[:, :, 1:] for a in atts]
        return (logits, atts) if return_attn else logits


# ------------------------------------------------ an EMA of the weights (theory.md, section 5)
class EMA:
    """A shadow copy of the parameters, averaged after every optimizer step (decay omega):
        avg_t = (1 - beta_t) avg_{t-1} + beta_t theta_t,   beta_t = (1 - omega) / (1 - omega^t)
    This is Adam's bias correction as a weight: avg_t averages theta_1 .. theta_t with weights
    proportional to omega^(t - k), so the initialization never enters it (theory.md, 5).
    plots/lab.py's BEMA changes beta() and averaged(), and keeps update()."""

    def __init__(self, model, decay):
        self.decay = decay
        self.t = 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def beta(self, t):
        return (1 - self.decay) / (1 - self.decay**t)

    @torch.no_grad()
    def update(self, model):
        # Exercise 1: count the step, then move each shadow tensor by beta_t towards theta_t.
        self.t += 1
        beta = self.beta(self.t)
        for avg, p in zip(self.shadow, model.parameters()):
            avg.lerp_(p, beta)  # avg + beta_t * (p - avg)
        # end of Exercise 1

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
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def learning_rate(cfg, step):
    """Constant, or a cosine decay from cfg.lr at step 1 to zero at the last step."""
    if cfg.lr_schedule == "cosine":
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / max(cfg.steps - 1, 1)))
    return cfg.lr


def train(cfg, task=None, log=print, averagers=None):
    """Train on the task (default Set Complement). Returns the last weights, the weight
    averages updated after every step (the EMA of cfg.ema, if cfg.ema > 0, or what
    averagers(model) returns: the lab's BEMA and grids), and the loss of every step."""
    task = task or SetComplement(cfg)
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)                      # the initialization
    gen = torch.Generator().manual_seed(cfg.seed)    # the training data, on the CPU
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if averagers:
        averages = averagers(model)
    else:
        averages = [EMA(model, cfg.ema)] if cfg.ema > 0 else []
    losses = []
    floor = task.loss_floor()
    t0 = time.time()
    every = max(1, cfg.steps // 8)   # log at step 10, then 8 times
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
        for avg in averages:
            avg.update(model)
        if step % every == 0 or step in (min(10, cfg.steps), cfg.steps):
            rate = step / max(time.time() - t0, 1e-9)
            recent = losses[-every:]
            log(f"step {step:5d}/{cfg.steps} | loss {sum(recent) / len(recent):.4f} (floor "
                f"{floor:.4f}) | {rate:.0f} steps/s | ETA {(cfg.steps - step) / rate:.0f}s")
    weights = list(model.parameters()) + [w for a in averages for w in a.averaged()]
    if not all(torch.isfinite(w).all() for w in weights):
        raise FloatingPointError(f"the weights became NaN or infinite by step {cfg.steps}")
    return model, averages, losses


# ------------------------------------------- evaluation at every length (theory.md, sections 2-4)
@torch.no_grad()
def evaluate(model, n_perm=None, task=None):
    """Metrics at every prefix length s = 1 .. v-1 of the task (default: Set Complement),
    averaged over n_perm fixed inputs: one pass over a whole permutation gives every length."""
    cfg = model.cfg
    was_training = model.training
    task = task or SetComplement(cfg)
    n_perm = n_perm or EVAL_PERMS
    device = next(model.parameters()).device
    model.eval()
    idx = task.eval_inputs(n_perm)                             # (N, T), on the CPU
    N, T = idx.shape
    # Inputs go through in chunks of about EVAL_CHUNK numbers: per position, its logits,
    # a layer's activations and every layer's attention weights.
    per_input = T * (cfg.vocab + 4 * cfg.n_embd + (T + 1) * cfg.n_head * cfg.n_layer)
    total = {}
    for chunk in idx.split(max(1, EVAL_CHUNK // per_input)):
        logits, atts = model(chunk.to(device), return_attn=True)   # (n, T, v)
        logits = logits.cpu().double()   # float64 on the CPU (MPS has none): TVDs of 1e-30
        p = task.target(chunk, torch.double)                   # (n, T, v)
        seen = p == 0          # the seen tokens; for a language, every illegal next token
        logq = F.log_softmax(logits, dim=-1)
        q = logq.exp()
        # Exercise 3: TVD = sum_j max(q_j - p*_j, 0), the excess of q over p* (= half the L1
        # distance, which float64 halves at 1e-26: exercises.md); the mass on the seen tokens
        # (p* = 0); the mean logit of the unseen tokens minus the mean logit of the seen ones.
        tvd = (q - p).clamp_min(0).sum(-1)
        invalid = (q * seen).sum(-1)
        gap = ((logits * ~seen).sum(-1) / (~seen).sum(-1)
               - (logits * seen).sum(-1) / seen.sum(-1))
        # end of Exercise 3
        # KL(p* || q): sums only over the unseen tokens, where p* > 0.
        kl = torch.where(seen, 0.0, p * (p.clamp_min(1e-30).log() - logq)).sum(-1)
        # Attention entropy, mean over heads and layers; uniform attention gives the most.
        att = torch.stack(atts).cpu().double()                 # (L, n, nh, T, T)
        h = -(att * att.clamp_min(1e-300).log()).sum(-1)       # (L, n, nh, T)
        batch = dict(tvd=tvd, invalid_mass=invalid, kl=kl, logit_gap=gap,
                     attn_entropy=h.mean(dim=(0, 2)))          # (n, T)
        if len(atts) > 1:   # a deeper model: each layer's entropy too
            batch.update({f"attn_entropy_layer{i + 1}": h[i].mean(1) for i in range(len(h))})
        for key, m in batch.items():   # sums over the inputs
            total[key] = total.get(key, 0) + m.sum(0)
    model.train(was_training)
    lengths = list(range(1, T + 1))
    metrics = {key: [float(x) / N for x in m] for key, m in total.items()}
    return {"length": lengths, **metrics,
            "log_positions": [math.log(s + (1 if cfg.bos else 0)) for s in lengths]}


# ------------------------------------- theory.md's laws for the logit gap (sections 2 and 4)
GAP_LAWS = {   # up to a constant factor: Pre-Norm's (section 2) and Post-Norm's (section 4)
    "pre": ("1/s", lambda s, v: 1 / s),
    "post": ("v / sqrt(s (v-s))", lambda s, v: v / math.sqrt(s * (v - s))),
}


# ----------------------------- theory.md's construction, by hand, in the model class that trains
def hand_built(vocab, norm, gamma=1.0):
    """One layer, one head, n_embd = 2v, no MLP, float64, and
      W_Q = W_K = 0          every score is 0, so attention is uniform over the prefix
      E[x] = e_(v+x)         token x sits in the second half of the features
      W_V W_O                writes the centred one-hot e_x - 1/v into the first half
      U[j] = -gamma e_j      logit j reads feature j, so seen tokens are pushed down
    The readout never sees the second half, so B = E U = 0. (nn.Linear stores W as (out, in):
    the transpose of theory.md's row-vector matrices.)"""
    v = vocab
    n = 2 * vocab   # the width; float64, so that TVDs far below 1e-7 are exact
    model = Transformer(Config(vocab=v, n_embd=n, n_head=1, n_layer=1, norm=norm)).double()
    attn = model.blocks[0].attn
    eye = torch.eye(v, dtype=torch.double)
    with torch.no_grad():
        for p in model.parameters():   # LayerNorms keep gain 1 and bias 0
            if p.dim() == 2:
                p.zero_()
        model.wte.weight[:, v:] = eye
        attn.c_attn.weight[2 * n:3 * n][:v, v:] = eye - 1.0 / v        # W_V
        attn.c_proj.weight.copy_(torch.eye(n, dtype=torch.double))     # W_O
        model.lm_head.weight[:, :v] = -gamma * eye
    return model.eval()



# ========================================================= Part 2: a single run, and its command line

# ----------------------------------------------------------------------------- files
def write_file(path, write, new=False):
    """write(tmp), then rename tmp (same folder) to path: nobody ever sees half a file. new: link
    tmp to path instead, which fails (FileExistsError) if path exists: never replaced."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        (os.link if new else os.replace)(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_outputs(out, files):
    """Write {name: text, figure or JSON object} into the folder out; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in files]
    for path, data in zip(paths, files.values()):
        if hasattr(data, "savefig"):
            write_file(path, lambda f: data.savefig(f, format="png", dpi=110))
        else:
            text = data if isinstance(data, str) else json.dumps(data, indent=1, allow_nan=False)
            write_file(path, lambda f: Path(f).write_text(text.rstrip("\n") + "\n", "utf-8"))
    return paths


def save_checkpoint(path, model, averager, cfg):
    """The config, the raw weights and the averaged ones (if any), for load_checkpoint."""
    ckpt = {"config": asdict(cfg), "model": model.state_dict()}
    if averager:
        ckpt["ema"] = [a.cpu() for a in averager.averaged()]
    write_file(path, lambda f: torch.save(ckpt, f), new=True)


def load_checkpoint(path, raw=False, device="cpu"):
    """A ready model in eval mode: the averaged weights if the run had them (unless raw)."""
    what = "an empty file" if os.path.getsize(path) == 0 else "not a file torch.save wrote"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        what = "a torch file without a resharpen.py config and weights"
        model = Transformer(Config(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
        ema = ckpt.get("ema", [])
        if len(ema) not in (0, len(list(model.parameters()))):
            raise ValueError   # an average of only some of the weights
        with torch.no_grad():
            for p, a in zip(model.parameters(), [] if raw else ema):
                p.copy_(a)
    except Exception:   # a file of another kind can fail anywhere in torch.load
        raise ValueError(f"{path} is not a resharpen.py checkpoint: {what}") from None
    return model.to(device).eval()


# ----------------------------------------------------------------------------- the printed table
def mean(xs):
    return sum(xs) / len(xs)


def summarize(metrics, train_len):
    """Mean TVD over the training lengths, beyond them (None if there are none), at the last."""
    tvd = metrics["tvd"]
    return {"tvd_train": mean(tvd[:train_len]),
            "tvd_extrap": mean(tvd[train_len:]) if tvd[train_len:] else None, "tvd_last": tvd[-1]}


def format_table(metrics, train_len, raw=None):
    n = len(metrics["length"])
    rows = sorted({1, 2, 4, train_len, train_len + 1, 2 * train_len, n} | set(range(8, n, 8)))
    log_n = "log(s+1)" if metrics["log_positions"][0] > 0 else "log s"   # BOS is one more
    head = f"{'s':>4} {'TVD':>7} {'invalid':>8} {'KL':>7} {'H(attn)':>8} {log_n:>8} {'gap':>7}"
    lines = [head + (f" {'TVD raw':>8}" if raw else "")]
    for s, i in ((r, r - 1) for r in rows if 1 <= r <= n):
        lines.append(f"{s:>4} {metrics['tvd'][i]:7.4f} {metrics['invalid_mass'][i]:8.4f} "
                     f"{metrics['kl'][i]:7.4f} {metrics['attn_entropy'][i]:8.3f} "
                     f"{metrics['log_positions'][i]:8.3f} {metrics['logit_gap'][i]:7.3f}"
                     + (f" {raw['tvd'][i]:8.4f}" if raw else "")
                     + ("   <- longest training length" if s == train_len else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the figures
def new_figure(ncols=1, width=5.2, height=3.8, nrows=1):
    """A figure of nrows x ncols axes (a list by rows, even of one), drawn off screen."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    return fig, list(fig.subplots(nrows, ncols, squeeze=False).ravel())


def shade_training(ax, train_len, n, label="training lengths"):
    """Grey band over the training lengths; x axis from 0.5 to n + 0.5."""
    ax.axvspan(0.5, train_len + 0.5, color="0.9", label=label, zorder=0)
    ax.set(xlabel="prefix length s", xlim=(0.5, n + 0.5))


def draw_laws(ax, s, gaps, L, v, **style):
    """theory.md's laws of the logit gap (GAP_LAWS), each equal to gaps[norm] at length L."""
    for (norm, (name, law)), ls in zip(GAP_LAWS.items(), (":", "--")):
        ax.plot(s, [gaps[norm] * law(x, v) / law(L, v) for x in s], ls, color="k",
                label=f"law of {norm}: {name}", **style)


def plot_length(metrics, cfg, raw=None, average="EMA"):
    """length.png: TVD; logit gap with theory.md's laws matched at L; attention entropy - log s."""
    fig, axes = new_figure(3)
    s, L, v = metrics["length"], cfg.train_len, cfg.vocab
    for m, color, lw, label in ([(raw, "tab:gray", 1.2, "raw weights")] if raw else []) + [
            (metrics, "tab:blue", 2, average if raw else "model")]:
        axes[0].plot(s, m["tvd"], color=color, lw=lw, label=label)
        axes[1].plot(s, m["logit_gap"], color=color, lw=lw)
        axes[2].plot(s, [h - u for h, u in zip(m["attn_entropy"], m["log_positions"])],
                     color=color, lw=lw)
    draw_laws(axes[1], s, {n: metrics["logit_gap"][L - 1] for n in GAP_LAWS}, L, v, lw=1)
    for ax, title, y in zip(axes, ("TVD to the exact target", "logit gap: unseen - seen",
                                   "attention entropy - log(positions)"),
                            (dict(ylim=(0, 1)), dict(yscale="log"), dict(ylim=(-1, 0.2)))):
        shade_training(ax, L, s[-1])
        ax.set(title=title, **y)
        ax.legend(fontsize=7)
    fig.suptitle(f"norm={cfg.norm}, targets={cfg.targets}, seed={cfg.seed}", fontsize=10)
    return fig


def plot_loss(losses, floor):
    """loss.png: the training loss, smoothed over 50 steps, and its floor."""
    fig, (ax,) = new_figure()
    k = min(50, len(losses))
    smooth = [sum(losses[i:i + k]) / k for i in range(len(losses) - k + 1)]
    ax.plot(range(k, len(losses) + 1), smooth, lw=1, label=f"loss ({k}-step mean)")
    ax.axhline(floor, color="k", ls="--", lw=1, label="floor: entropy of the target")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="training loss")
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------- the run
def finite(metrics):
    return all(math.isfinite(x) for key, xs in metrics.items() if key != "length" for x in xs)


def run_one(cfg, out, save=None):
    """python resharpen.py [flags]: train, evaluate, print the table, write metrics and figures."""
    task, L = SetComplement(cfg), cfg.train_len
    average = f"EMA {cfg.ema}" if cfg.ema > 0 else "none"
    print(f"{task.name}: v={cfg.vocab}, train lengths 1..{L}, norm={cfg.norm} "
          f"[{NORMS[cfg.norm]}], averaging={average}, targets={cfg.targets}, "
          f"lr={cfg.lr} {cfg.lr_schedule}, seed={cfg.seed}, device={pick_device(cfg.device)}")
    t0 = time.time()
    model, averages, losses = train(cfg, task)
    train_time, raw = time.time() - t0, evaluate(model, task=task)
    metrics = evaluate(averaged_copy(model, averages[0]), task=task) if averages else raw
    raw = raw if averages else None
    if not all(finite(m) for m in (metrics, raw) if m):
        raise FloatingPointError("the metrics are not finite (the logits overflow)")
    print(f"\nevaluated on {EVAL_PERMS} fixed inputs" +
          (f" with the {average} weights (raw weights in the last column)" if raw else ""))
    print(format_table(metrics, L, raw))
    summary, r = summarize(metrics, L), raw and summarize(raw, L)
    beyond = summary["tvd_extrap"] is not None
    print(f"\nmean TVD: training lengths {summary['tvd_train']:.4f} | extrapolation " + (
        f"{L + 1}..{len(metrics['length'])} {summary['tvd_extrap']:.4f}" if beyond else
        "none (every length was trained)") + (
        f"   (raw weights: {r['tvd_train']:.4f} | {r['tvd_extrap']:.4f})" if r and beyond else ""))
    record = {"config": asdict(cfg), **metrics, "summary": summary,
              "train_seconds": round(train_time, 2)}
    if raw:
        record["raw"] = {**raw, "summary": r}
    written = write_outputs(out, {"length.png": plot_length(metrics, cfg, raw, average),
                                  "loss.png": plot_loss(losses, task.loss_floor()),
                                  "metrics.json": record})
    try:
        if save:
            save_checkpoint(save, model, averages[0] if averages else None, cfg)
    except FileExistsError:   # another run, started with the same --save, wrote it first
        sys.exit(f"resharpen.py: --save {save}: another run wrote it first; wrote "
                 f"{', '.join(written)}")
    print(f"wrote {', '.join(written + [save] * bool(save))} | {time.time() - t0:.1f}s")


# ------------------------------------------------------- the hand-out (starter.py leaves it out)
# python resharpen.py --handout --out FOLDER: the exercise sheet, a starter file and its graders
HANDOUT = ("exercises.md", "starter.py", "grade.py")
LAB_MODES = ("--compare", "--suite", "--search", "--alternatives", "--theory", "--tables")


def starter_source():
    """This file without the hand-out, under a note, with the code of Exercises 1-3 replaced by
    NotImplementedError: between '# Exercise N: ...' and '# end of Exercise N' the comments stay
    and the code goes. The students run it as starter.py."""
    out, exercise, skip = ["# starter.py: write Exercises 1-3 below; exercises.md holds all the "
                           "exercises need.\n# theory.md, plots/lab.py and the READMEs cited "
                           "below are the project's, kept back (theory.md until after Exercise "
                           "10)."], None, False
    for line in Path(__file__).read_text("utf-8").replace("resharpen.py", "starter.py").split("\n"):
        if line.startswith("# ---"):   # a section banner: the hand-out's is left out, to the next
            skip = "the hand-out" in line
        if skip or line.endswith("# not in starter.py"):
            continue
        if (begin := re.match(r"\s*# Exercise (\d): ", line)) and not exercise:
            exercise, raised = begin.group(1), False
        elif exercise and line.strip() == f"# end of Exercise {exercise}":
            exercise = None
            continue
        elif exercise and not line.strip().startswith("#"):
            if not raised:
                indent = line[:len(line) - len(line.lstrip())]
                out.append(f'{indent}raise NotImplementedError("Exercise {exercise}: write '
                           'this part (see exercises.md)")')
                raised = True
            continue
        out.append(line)
    return "\n".join(out)


GRADE_HEADER = '''"""Graders of Exercises 1-3, copied from resharpen.py's tests by --handout. In this folder:
    python -m pytest -q grade.py -k write_ema      (or write_post, write_metrics)
grades starter.py here, or the file RESHARPEN names."""
import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

REFERENCE = None   # the file graded is starter.py, or RESHARPEN's
'''


def handout(args, parser):
    """OUT/exercises.md (the README's Exercises), starter.py (to complete), grade.py (graders),
    into a folder that holds none of them yet: a teacher's edited sheet is never replaced."""
    here, out = os.path.dirname(os.path.abspath(__file__)), args.out or "runs"
    if other := [k for k, v in vars(args).items() if v is not None and k not in ("handout", "out")]:
        parser.error(f"--{other[0].replace('_', '-')}: --handout takes only --out")
    if there := [f for f in HANDOUT if os.path.lexists(os.path.join(out, f))]:
        parser.error(f"--out {out}: it already holds {there[0]}; --handout writes only into a "
                     "folder without exercises.md, starter.py and grade.py")
    check_out(args.out, parser.error)
    section = Path(here, "README.md").read_text("utf-8").split("\n## Exercises\n", 1)[1].split(
        "\n## ", 1)[0]   # to the next section
    kept = [p for p in section.split("\n\n") if not p.lstrip().startswith("*For the teacher")]
    body = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", "\n\n".join(kept).strip())   # no links
    tests = Path(here, "test_resharpen.py").read_text("utf-8")
    graders = tests[tests.index("# ---- graders"):tests.index("# end of the graders")]
    written = write_outputs(out, dict(zip(HANDOUT, [
        f"# Exercises: Post-Norm can Resharpen Attention\n\n{body}\n", starter_source(),
        GRADE_HEADER + "\n\n" + graders])))
    print(f"wrote {', '.join(written)}: the exercises without the answers, the starter file "
          "and its graders")


# ----------------------------------------------------------------------------- command line
FLAGS = [   # (flag, a type, a list of choices or bool for a switch, help); every default None
    ("--vocab", int, "vocabulary size v"),
    ("--train-len", int, "train on prefix lengths 1 .. this"),
    ("--targets", ["sampled", "exact"], "a sampled next token, or the exact distribution"),
    ("--n-layer", int, "number of blocks"), ("--n-embd", int, "width of the residual stream"),
    ("--n-head", int, "attention heads per block, dividing --n-embd"),
    ("--mlp", bool, "add an MLP to each block (off: attention only)"),
    ("--bos", bool, "prepend a beginning-of-sequence token to every input"),
    ("--steps", int, "optimizer steps"), ("--batch-size", int, "sequences per step"),
    ("--lr", float, "AdamW learning rate"),
    ("--lr-schedule", ["constant", "cosine"], "constant, or a cosine decay to zero"),
    ("--seed", int, "seed of the initialization and the training data"),
    ("--device", ["auto", "cpu", "cuda", "mps"], "auto: cuda, then mps, then cpu"),
    ("--out", str, "folder for the figures and records (default runs)"),
    ("--norm", list(NORMS), "where the LayerNorm sits, below"),
    ("--post-norm", dict(action="store_const", dest="norm", const="post"), "same as --norm post"),
    ("--ema", float, "weight EMA decay; 0 = off"),
    ("--save", str, "write a checkpoint (config, raw and averaged weights) to this new .pt file"),
    ("--handout", bool, "write a class's exercise sheet, starter file and graders"),  # not in starter.py
]
LIMITS = {"vocab": (3, 1024), "train_len": (1, 1024), "n_layer": (1, 16), "n_head": (1, 64),
          "n_embd": (1, 2048), "batch_size": (1, 8192), "steps": (1, 10**7), "seed": (0, 2**32 - 5),
          "lr": (1e-12, 1e6), "ema": (0, 0.999999)}
MEMORY_LIMIT = 8 * 2**30   # bytes the runs of a command may hold at once (peak_memory)


def build_parser(flags=FLAGS, exclusive=({"--norm", "--post-norm"},), doc=__doc__, norm="--norm"):
    """Every flag defaults to None: the checks see which were given; Config fills the rest."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=doc.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"where the LayerNorm sits ({norm}):\n" + "\n".join(
                                    f"  {k:14s} {v}" for k, v in NORMS.items()))
    p.error = lambda msg: p.exit(2, f"{p.prog}: error: {msg}\n")   # one line naming the flag
    groups = [(names, p.add_mutually_exclusive_group()) for names in exclusive]
    for name, kind, text in flags:
        default = getattr(Config(), name[2:].replace("-", "_"), None)
        text += f" (default {default})" if default is not None and kind is not bool else ""
        kw = (kind if isinstance(kind, dict) else dict(choices=kind) if isinstance(kind, list)
              else dict(action="store_true") if kind is bool else dict(type=kind))
        group = next((g for names, g in groups if name in names), p)
        group.add_argument(name, help=text, default=None, **kw)
    return p


def peak_memory(cfg, n_eval=None):
    """A rough upper estimate of one run's peak, in bytes: the libraries, 12 copies of the weights,
    a step's activations, attention and logits with gradients, an evaluation chunk (inputs of
    n_eval tokens, default v - 1)."""
    T, C, L = cfg.train_len + cfg.bos, cfg.n_embd, cfg.n_layer
    params = L * (4 + 8 * cfg.mlp) * C * C + (2 * cfg.vocab + cfg.bos) * C
    per_token = (L * (4 * cfg.n_head * T + 16 * C * (1 + 2 * cfg.mlp))
                 + (16 if cfg.targets == "exact" else 4) * cfg.vocab)
    n = (n_eval or cfg.vocab - 1) + cfg.bos
    per_input = n * (cfg.vocab + 4 * C + (n + 1) * cfg.n_head * L)
    return 2**29 + 48 * params + 16 * cfg.batch_size * T * per_token + 32 * max(EVAL_CHUNK, per_input)


def check_ranges(args, bad, limits=LIMITS):
    for name, (lo, hi) in limits.items():
        if getattr(args, name, None) is not None and not lo <= getattr(args, name) <= hi:
            bad(f"--{name.replace('_', '-')} must be in {lo:{'g' * isinstance(lo, float)}} .. "
                f"{hi:{'g' * isinstance(hi, float)}}, got {getattr(args, name)}")


def check_model(runs, workers, bad, n_eval=None):
    """Every run: heads that divide the width, a device that is here; and the runs trained at
    once fit in MEMORY_LIMIT."""
    cfg = runs[0]
    if any(run.n_embd % run.n_head for run in runs):
        bad(f"--n-head {cfg.n_head} must divide the width, --n-embd {cfg.n_embd}")
    device = pick_device(cfg.device)
    if device == "cuda" and not torch.cuda.is_available() or (
            device == "mps" and not torch.backends.mps.is_available()):
        bad(f"--device {device}: there is no such device here; use auto or cpu")
    if (need := workers * max(peak_memory(r, n_eval) for r in runs)) > MEMORY_LIMIT:
        bad(f"--batch-size {cfg.batch_size}: about {need / 2**30:.0f} GiB at the peak ({workers} "
            f"run(s) at once; limit {MEMORY_LIMIT // 2**30} GiB): use a smaller --batch-size, "
            "--n-embd, --n-layer, --n-head, --train-len or --vocab")


def check_out(out, bad, writes=(".png", ".json", ".md", ".jsonl")):
    """--out (None: runs): no folder where a file goes; written once now, under a name no user file
    has."""
    if out == "":
        bad("--out '': give a folder name, such as runs")
    out = out or "runs"
    path = os.path.abspath(out)
    if clash := [f for f in sorted(os.listdir(path)) if f.endswith(writes) and
                 os.path.isdir(os.path.join(path, f))] if os.path.isdir(path) else []:
        bad(f"--out {out}: {clash[0]} there is a folder, where a run writes a file")
    probe(out, os.path.join(path, f".{os.getpid()}.probe"), "--out", bad)


def probe(path, name, flag, bad):
    try:   # the folder is made, and a file written and removed in it, now
        os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
        open(name, "wb").close()
        os.remove(name)
    except OSError as e:
        bad(f"{flag} {path!r}: {e.strerror or e}")


def check_args(args, parser):
    """Refuse bad input before training (exit 2, one line naming the flag); returns the Config."""
    bad = parser.error
    cfg = Config(**{k: v for k, v in vars(args).items()
                    if v is not None and k in Config.__dataclass_fields__})
    check_ranges(args, bad)
    check_model([cfg], 1, bad)
    if cfg.train_len > cfg.vocab - 1:
        bad(f"--train-len must be at most {cfg.vocab - 1} (v - 1), got {cfg.train_len}")
    save, out = os.path.realpath(args.save or "."), os.path.realpath(args.out or "runs")
    if args.save is not None and (not args.save.endswith(".pt") or os.path.lexists(args.save) or
                                  os.path.commonpath([save, out]) == save):   # --out in it
        bad(f"--save {args.save!r}: a new file name ending in .pt for the checkpoint, such as "
            "runs/model.pt; not an existing file or folder, nor the --out folder")
    if args.save:
        probe(args.save, f"{args.save}.{os.getpid()}.probe", "--save", bad)
    check_out(args.out, bad)
    return cfg


def stop(run, prog, after=lambda code: ""):
    """run(); on Ctrl-C, a NaN or no memory, one line (after(code): what was kept) and exit 130 or
    1; if the reader of a pipe (| head) stopped, exit 1 quietly."""
    try:
        return run()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except KeyboardInterrupt:
        code, why = 130, "interrupted (Ctrl-C); the files already written are whole"
    except FloatingPointError as e:
        code, why = 1, f"stopped: {e}; try a smaller --lr."
    except (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError)):   # torch < 2.5
        code, why = 1, "out of memory; try a smaller --batch-size, --vocab or --n-embd"
    print(f"{prog}: {why}{after(code)}", file=sys.stderr)
    sys.exit(code)


def main(argv=None):
    """The command line. Exit status: 0 done, 1 stopped (NaN, memory), 2 bad input, 130 Ctrl-C."""
    os.environ["MPLBACKEND"] = "agg"   # figures are drawn off screen
    parser, argv = build_parser(), sys.argv[1:] if argv is None else argv
    if lab := [a for a in argv if a.split("=")[0] in LAB_MODES]:  # not in starter.py
        mode = lab[0].split("=")[0]  # not in starter.py
        parser.error(f"{mode} is the lab's: python plots/lab.py {mode} ...")  # not in starter.py
    args = parser.parse_args(argv)
    if args.handout:  # not in starter.py
        return handout(args, parser)  # not in starter.py
    cfg = check_args(args, parser)
    stop(lambda: run_one(cfg, args.out or "runs", args.save), "resharpen.py",
         lambda code: " Nothing was written." if code == 1 else "")


if __name__ == "__main__":
    main()
