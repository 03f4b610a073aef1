"""plots/lab.py: the experiments of the lab notebook (plots/README.md), on top of resharpen.py.

Every grid, its runner (one run per core, --resume after Ctrl-C), statistics, tables and figures,
and what only the grids use (BEMA, the formal languages, log-length scaling), plugged into Part 1
through a task object, the ATTENTIONS table and train()'s `averagers`. One mode a command:
    python plots/lab.py --compare --steps 50    # a short comparison; the notebook gives each command
    python plots/lab.py --help                  # the modes and their flags
"""

import argparse
import functools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # resharpen.py, in workers too
if __name__ == "__main__":   # before torch loads: one thread per run (README, "Threads")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch   # noqa: E402
import torch.nn as nn   # noqa: E402
import torch.nn.functional as F   # noqa: E402

import resharpen as R   # noqa: E402
from resharpen import (ATTENTIONS, EMA, EVAL_SEED, GAP_LAWS, NORMS, CausalSelfAttention,  # noqa
                       Config, SetComplement, averaged_copy, draw_laws, evaluate, finite,
                       hand_built, mean, new_figure, pick_device, shade_training, summarize,
                       train, write_file, write_outputs)


# -------------------------------------------------------------------------------------------- BEMA
class BEMA(EMA):
    """Bias-corrected EMA (Block & Zhang 2025, "EMA Without the Lag"), with their defaults:
        beta_t  = (rho + gamma t)^-kappa            the weight of the new iterate
        alpha_t = (rho + gamma t)^-eta              the strength of the correction
        ema_t   = (1 - beta_t) ema_{t-1} + beta_t theta_t,   ema_0 = theta_0
        bema_t  = alpha_t (theta_t - theta_0) + ema_t
    theta_0 is the initialization (no burn-in). Adding back a fraction of the drift since
    theta_0 cancels an average's lag behind moving weights; computed from the live theta_t."""

    def __init__(self, model, kappa=0.5, eta=0.2, rho=10.0, gamma=1.0, correct=True):
        super().__init__(model, decay=None)
        self.kappa, self.eta, self.rho, self.gamma, self.correct = kappa, eta, rho, gamma, correct
        self.theta0 = [p.detach().clone() for p in model.parameters()]
        self.params = list(model.parameters())   # live: theta_t after the t-th update

    def beta(self, t):
        return (self.rho + self.gamma * t) ** -self.kappa

    @torch.no_grad()
    def averaged(self):
        alpha = (self.rho + self.gamma * self.t) ** -self.eta if self.correct else 0.0
        return [s + alpha * (p - p0) for s, p, p0 in zip(self.shadow, self.params, self.theta0)]


# --------------------------------------------------------------------------------------- languages
# Formal languages with several legal next tokens: Dyck-(k, D) and Shuffle-k. Tokens: 0 .. k-1
# open brackets, k .. 2k-1 their closes, 2k END. A stream is a run of strings, each ended by END,
# after which the next string starts from the empty state; so every position has an exact
# next-token distribution, given by a small automaton (theory.md, Appendix D).
class Language:
    """Dyck-(k, D) or Shuffle-k (cfg.task 'dyck' or 'shuffle'), with SetComplement's methods."""

    def __init__(self, cfg):
        assert cfg.vocab == 2 * cfg.brackets + 1, "make a language with make_task"
        self.cfg = cfg
        self.name = (f"Dyck-({cfg.brackets}, {cfg.max_depth})" if cfg.task == "dyck"
                     else f"Shuffle-{cfg.brackets}")

    def start(self, n):
        """The automaton's state for n rows, before any token."""
        k, D = self.cfg.brackets, self.cfg.max_depth
        return {"count": torch.zeros(n, k, dtype=torch.long),   # opens - closes, per type
                "stack": torch.zeros(n, D, dtype=torch.long),   # open types, bottom first
                "depth": torch.zeros(n, dtype=torch.long)}

    def distribution(self, state, dtype=torch.float):
        """The exact next-token distribution of every row, (n, 2k + 1). Dyck (Hewitt et al.
        2020): empty stack: each open 1/(2k), END 1/2; full (depth D): the matching close; else
        each open 1/(2k), the matching close 1/2. Shuffle (Bhattamishra et al. 2020): uniform
        over the opens, the closes whose counter is above 0, and END when all counters are 0."""
        k, depth = self.cfg.brackets, state["depth"]
        if self.cfg.task == "shuffle":
            legal = torch.cat([torch.ones_like(state["count"]), state["count"] > 0,
                               (state["count"] == 0).all(1, keepdim=True)], dim=1).to(dtype)
            return legal / legal.sum(1, keepdim=True)
        empty, full = depth == 0, depth == self.cfg.max_depth
        top = state["stack"].gather(1, (depth - 1).clamp(min=0)[:, None])      # (n, 1)
        p = torch.zeros(len(depth), 2 * k + 1, dtype=dtype)
        p[:, :k] = torch.where(full, 0.0, 1 / (2 * k)).to(dtype)[:, None]
        p[:, 2 * k] = torch.where(empty, 0.5, 0.0).to(dtype)
        close = torch.where(empty, 0.0, torch.where(full, 1.0, 0.5)).to(dtype)
        return p.scatter(1, k + top, close[:, None])   # an empty stack's 'close' writes a 0

    def step(self, state, tok):
        """Advance every row's automaton by one token (n,)."""
        k, D = self.cfg.brackets, self.cfg.max_depth
        sign = (tok < k).long() - ((tok >= k) & (tok < 2 * k)).long()   # +1 open, -1 close, 0 END
        kind, slot = tok % k, state["depth"].clamp(0, D - 1)[:, None]
        pushed = torch.where(sign > 0, kind, state["stack"].gather(1, slot)[:, 0])
        state["stack"].scatter_(1, slot, pushed[:, None])
        state["depth"] = (state["depth"] + sign).clamp(0, D)
        state["count"] += F.one_hot(kind, k) * sign[:, None]

    def sample(self, n, T, generator=None):
        """n streams of T tokens, each token drawn from the automaton's distribution."""
        state, tokens = self.start(n), []
        for _ in range(T):
            tok = torch.multinomial(self.distribution(state), 1, generator=generator)[:, 0]
            self.step(state, tok)
            tokens.append(tok)
        return torch.stack(tokens, dim=1)

    def target(self, idx, dtype=torch.float):
        """The exact next-token distribution after every prefix: (B, T) -> (B, T, v)."""
        state, out = self.start(idx.shape[0]), []
        for t in range(idx.shape[1]):
            self.step(state, idx[:, t].cpu())
            out.append(self.distribution(state, dtype))
        return torch.stack(out, dim=1).to(idx.device)

    def eval_inputs(self, n):
        """Fixed streams of 4 x train_len tokens: positions up to 4 times the training's."""
        return self.sample(n, 4 * self.cfg.train_len, torch.Generator().manual_seed(EVAL_SEED))

    def loss_floor(self):
        """The target's entropy over the training positions, on 2000 fixed streams."""
        g = torch.Generator().manual_seed(EVAL_SEED)
        p = self.target(self.sample(2000, self.cfg.train_len, g), torch.double)
        return -(p * p.clamp_min(1e-30).log()).sum(-1).mean().item()


def make_task(cfg):
    """The task object cfg names; a language's Config, with vocabulary 2k + 1, is task.cfg."""
    return (SetComplement(cfg) if cfg.task == "complement" else
            Language(replace(cfg, vocab=2 * cfg.brackets + 1)))


# ------------------------------------------------------------------------------ log-length scaling
class LogLengthAttention(CausalSelfAttention):
    """--attn-scale logn (Scalable-Softmax, Nakanishi 2025): a query that sees n positions (BOS
    included) attends by softmax(s_h log(n) q k^T / sqrt(head size)), s_h learned, initially 1."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.log_scale = nn.Parameter(torch.ones(cfg.n_head))   # s_h

    def scores(self, q, k):
        n = torch.arange(1, q.shape[2] + 1, device=q.device, dtype=q.dtype)   # (T,)
        return super().scores(q, k) * (self.log_scale[:, None, None] * n.log()[:, None])


ATTENTIONS["logn"] = LogLengthAttention


# --------------------------- the runner: every grid's runs, one per core, a runs file for --resume
COMPARE_SEEDS, COMPARE_EMA = 3, 0.999   # seeds per setting; every grid's EMA decay
REGIMES = (("sampled", "constant"), ("sampled", "cosine"), ("exact", "constant"),
           ("exact", "cosine"))   # (targets, learning-rate schedule): where the noise comes from
AVERAGES = ("raw", "ema", "bema")
AVERAGE_LABELS = {"raw": "none", "ema": f"EMA {COMPARE_EMA}", "bema": "BEMA"}
AVERAGERS = {"ema": lambda m: EMA(m, COMPARE_EMA), "bema": BEMA}
COLORS = {"pre": "tab:red", "pre-final": "tab:orange", "post": "tab:blue",
          "post-residual": "tab:purple"}


def train_and_evaluate(cfg, averages=("ema", "bema"), threads=None):
    """Train one configuration; evaluate its raw weights and each average (AVERAGERS)."""
    if threads:
        torch.set_num_threads(threads)
    t0, task = time.time(), make_task(cfg)
    model, avgs, _ = train(cfg, task, log=lambda *a: None,
                           averagers=lambda m: [AVERAGERS[a](m) for a in averages])
    result = {"raw": evaluate(model, task=task), **{
        a: evaluate(averaged_copy(model, avg), task=task) for a, avg in zip(averages, avgs)}}
    if not all(finite(m) for m in result.values()):
        raise FloatingPointError(f"the metrics of {cfg} are not finite")
    return cfg, result, time.time() - t0


def grid_workers(runs, device):
    """Every CPU core this process may use, one run each; one run at a time on a GPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cores or 1, len(runs)) if device == "cpu" else 1


def config(record, build=Config):   # from JSON (records older than Config.bema's hold "bema")
    return build(**{k: v for k, v in record.items() if k != "bema"})


@dataclass
class RunsFile:
    """OUT/MODE.runs.jsonl (main names it): a grid's finished runs, one JSON line each, which the
    same command with --resume keeps. resumed: how many of them run_grid took from it."""
    path: str
    resumed: int = 0

    def finished(self):
        """{config: (result, seconds)} of the runs there (check_runs_file has read each line)."""
        if not os.path.exists(self.path):
            return {}
        text = Path(self.path).read_bytes().decode("utf-8")   # as check_runs_file read it
        text = text[:text.rfind("\n") + 1]   # less a last line cut short by a kill
        write_file(self.path, lambda f: Path(f).write_text(text, "utf-8"))
        runs = [json.loads(line) for line in text.split("\n")[:-1]]
        return {config(r.pop("config")): (r, r.pop("seconds"), r.pop("device"))[:2] for r in runs}

    def append(self, cfg, device, seconds, result):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"config": asdict(cfg), "device": device, "seconds": seconds,
                                **result}) + "\n")


def check_runs_file(path, runs, device, mode, resume, bad):
    """A grid keeps the runs an interrupted command left in path only with --resume, and only
    if each line is a run of this grid: a runs file is never overwritten or lost unnoticed."""
    todo, planned = "rerun the command that wrote it, with --resume, or remove the file", set(runs)
    try:
        text = Path(path).read_bytes().decode("utf-8") if os.path.exists(path) else ""
    except UnicodeDecodeError:
        bad(f"{path}: not UTF-8 text (an editor re-saved it, or it is no runs file): save it as "
            "UTF-8 or remove it")
    lines = text.split("\n")[:-1]   # a last line without its newline was cut short by a kill
    if lines and not resume:
        bad(f"{path} holds {len(lines)} finished run(s) of an earlier command: {todo}")
    if resume and not lines:   # a finished grid removes its runs file
        print(f"--resume: no finished run in {path}, so every run trains now")
    keys = {"config", "device", "seconds", "raw", "ema", *["bema"] * (mode in ("compare", "suite"))}
    for i, line in enumerate(lines, 1):
        if why := runs_line_problem(line, keys, planned, device):
            bad(f"{path}, line {i}: not a run of this command ({why}) ({len(lines)} line(s) in "
                f"the file): {todo}")


def runs_line_problem(line, keys, planned, device):
    """Why a line of a runs file is not one of the planned runs on this device; None if it is."""
    if not line.strip() or line.startswith("\ufeff"):
        return "it is blank" if not line.strip() else "it starts with a byte-order mark"
    try:
        r = json.loads(line)
    except ValueError:
        return "not JSON"
    if not isinstance(r, dict) or (missing := sorted(keys - set(r))):
        return f"no key {missing[0]!r}" if isinstance(r, dict) else "not a JSON object"
    kinds = {k: (int, float) if type(v) is float else type(v) for k, v in asdict(Config()).items()}
    c = isinstance(r["config"], dict) and config(r["config"], dict)
    if not (isinstance(c, dict) and set(c) <= set(kinds) and isinstance(r["seconds"], (int, float))
            and all(isinstance(v, kinds[k]) for k, v in c.items())):
        return "a value of the wrong kind in its config or seconds"
    if not 0 <= r["seconds"] < math.inf:
        return f"its seconds {r['seconds']}, not a number of seconds"
    c = Config(**c)   # what differs from the nearest run of this command:
    why = min(([f"{k} {getattr(c, k)!r}" for k in kinds if getattr(c, k) != getattr(p, k)]
               for p in planned), key=len) + [f"run on {r['device']}"] * (r["device"] != device)
    if why:
        return "its " + ", ".join(why)
    n = len(make_task(c).eval_inputs(1)[0])   # every length and every metric evaluate() writes
    want = {"length", "tvd", "invalid_mass", "kl", "logit_gap", "attn_entropy", "log_positions",
            *[f"attn_entropy_layer{i}" for i in range(1, c.n_layer + 1) if c.n_layer > 1]}
    top = {"tvd": 1 + 1e-9, "invalid_mass": 1 + 1e-9}   # masses; the rest within +-1e4
    if not all(isinstance(m := r[a], dict) and set(m) == want and all(
            isinstance(xs, list) and len(xs) == n and all(type(x) in (int, float) and -1e4 * (
                k not in top) <= x <= top.get(k, 1e4) for x in xs)
            for k, xs in m.items()) for a in keys - {"config", "device", "seconds"}):
        return f"a metric that is not {n} numbers in its range (a TVD in 0 .. 1, the rest +-1e4)"


def run_grid(runs, device, averages=("ema", "bema"), later=0, runs_file=None):
    """Train and evaluate the runs, one per core, printing a line each (its ETA counts `later` runs
    too); append each to runs_file, skip those there. Returns (results in order, wall, workers)."""
    workers, t0, pool = grid_workers(runs, device), time.time(), None
    old = runs_file.finished() if runs_file else {}
    done, todo = [(c, *old[c]) for c in runs if c in old], [c for c in runs if c not in old]
    before = sum(d[2] for d in done) / workers
    if done:
        runs_file.resumed += len(done)
    print(f"{len(runs)} training runs on {device}, {workers} at a time" +
          (f"; {len(done)} done before, in {runs_file.path}" if done else ""), flush=True)
    try:
        if workers > 1:
            import multiprocessing.resource_tracker
            # The workers start with Ctrl-C blocked (inherited): this process stops them. A Ctrl-C
            # while they start is not lost: it stops the grid (POSIX; Windows has no signal masks).
            block = getattr(signal, "pthread_sigmask", None)
            if block:   # the resource tracker's first start unblocks Ctrl-C: start it first
                multiprocessing.resource_tracker.ensure_running()
                mask = block(signal.SIG_BLOCK, {signal.SIGINT})
            pool = multiprocessing.get_context("spawn").Pool(workers)
            if block:
                block(signal.SIG_SETMASK, mask)
            results = pool.imap_unordered(functools.partial(
                train_and_evaluate, averages=averages, threads=1), todo)
        else:
            results = (train_and_evaluate(cfg, averages) for cfg in todo)
        for cfg, result, seconds in results:
            done.append((cfg, result, seconds))
            if runs_file:
                runs_file.append(cfg, device, seconds, result)
            eta = mean([d[2] for d in done]) * math.ceil((len(runs) - len(done) + later) / workers)
            tvds = " ".join(f"{a} {summarize(m, cfg.train_len)['tvd_extrap']:.3f}"
                            for a, m in result.items())
            print(f"[{len(done):2d}/{len(runs)}] {make_task(cfg).name:13s} {cfg.norm:13s} "
                  f"{cfg.targets:7s} {cfg.lr_schedule:8s} lr {cfg.lr:g} seed {cfg.seed} | "
                  f"extrapolation TVD {tvds} | {seconds:.0f}s | ETA {eta:.0f}s", flush=True)
    finally:
        if pool:
            pool.terminate()
    done.sort(key=lambda d: runs.index(d[0]))   # grid order, whichever finished first
    return done, time.time() - t0 + before, workers


def finish(out, name, text, command, details, figures, grid, runs_file=None, **record):
    """Print the table with the grid's size and time; write name.md, the figures, name.json; then
    remove the runs file, whose runs are all in name.json. grid: what run_grid returned."""
    (done, wall, workers), resumed = grid, runs_file.resumed if runs_file else 0
    wall = round(wall, 1)   # the table's seconds are the JSON's
    text += f"{len(done)} training runs, {wall:.0f} s wall in {workers} worker process(es)" + (
        f", {resumed} of them resumed from an interrupted command (the wall counts their own "
        f"seconds / {workers})." if resumed else ".")
    record.update(wall_seconds=wall, runs=[{"config": asdict(c), **r} for c, r, _ in done])
    md = f"Written by `{command}` ({details}).\n\n{text}\n"
    print("\n" + text)
    written = write_outputs(out, {f"{name}.md": md, **figures, f"{name}.json": record})
    if runs_file and set(runs_file.finished()) <= {c for c, _, _ in done}:
        Path(runs_file.path).unlink(missing_ok=True)   # every run is in the JSON record now
    print(f"wrote {', '.join(written)} | {wall:.0f}s")


# -------------------------------------------------------------------------------------- statistics
def mean_sd(values, digits=3):
    """'mean +- sample standard deviation', for the tables."""
    m = mean(values)
    sd = math.sqrt(sum((x - m) ** 2 for x in values) / max(len(values) - 1, 1))
    return f"{m:.{digits}f} +- {sd:.{digits}f}"
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306,
       10: 2.262}   # Student's t, two-sided 95 %, by the number of paired values (n - 1 df)


def mean_interval(xs):
    """Mean of paired differences and its 95 % t interval (the seeds are the pairs)."""
    n, m = len(xs), mean(xs)
    half = T95[n] * math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)
    return m, m - half, m + half


def wilson(k, n, z=1.96):
    """95 % Wilson score interval of a proportion k / n."""
    p, d = k / n, 1 + z * z / n
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (p + z * z / (2 * n)) / d - half, (p + z * z / (2 * n)) / d + half


def sign_test(k, n):
    """Two-sided exact sign test: the chance of a split at least as uneven as k of n."""
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n)


def wilcoxon(diffs):
    """Two-sided exact Wilcoxon signed-rank test (zeros dropped, tied |d| share their mean
    rank): the distribution of the positive rank sum, counted over all 2^n sign patterns."""
    d = [x for x in diffs if x != 0]
    a = sorted(abs(x) for x in d)
    ranks = [2 * a.index(abs(x)) + a.count(abs(x)) + 1 for x in d]   # twice the mean rank
    counts = {0: 1}
    for r in ranks:
        counts = {t: counts.get(t, 0) + counts.get(t - r, 0) for t in range(sum(ranks) + 1)}
    w, mid = sum(r for r, x in zip(ranks, d) if x > 0), sum(ranks) / 2
    return min(1.0, sum(c for t, c in counts.items() if abs(t - mid) >= abs(w - mid)) / 2**len(d))


@functools.lru_cache(maxsize=None)   # the same values recur in several subgroups
def bootstrap_median(xs, reps=10000, seed=0):
    """Median of the tuple xs and its 95 % percentile-bootstrap interval (fixed seed)."""
    g = random.Random(seed)
    meds = sorted(statistics.median(g.choices(xs, k=len(xs))) for _ in range(reps))
    return statistics.median(xs), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def search_stats(pairs, ref="post"):
    """ref's win rate (log ratio > 0), sign and Wilcoxon tests (both drop ties), median ratio."""
    logs = [x for x, _ in pairs]
    n, k, ties = len(logs), sum(x > 0 for x in logs), sum(x == 0 for x in logs)
    if n == 0:
        return {"n": 0}
    med, lo, hi = bootstrap_median(tuple(logs))
    return {"n": n, f"{ref}_wins": k, "win_rate": k / n, "win_rate_95": wilson(k, n),
            "sign_p": sign_test(k, n - ties) if n > ties else 1.0, "wilcoxon_p": wilcoxon(logs),
            "median_ratio": math.exp(med), "median_ratio_95": (math.exp(lo), math.exp(hi))}


# ----------------------------------------------------------------- tables and figures of the grids
def md_table(header, rows):
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def tvd_cells(metrics, L):
    """'mean +- sd' over seeds of the TVD: on the training lengths, beyond, at the longest."""
    sums = [summarize(m, L) for m in metrics]
    return [mean_sd([x[k] for x in sums]) for k in ("tvd_train", "tvd_extrap", "tvd_last")]


def plot_panels(panels, train_len, n, ncol=4, overlay=None):
    """Metrics against length s = 1 .. n, a panel per (title, ylabel, axis settings, curves);
    a curve {label: (color, [a list per seed], style)} is its mean with a min-max band."""
    fig, axes = new_figure(len(panels), width=4.8 if len(panels) < 4 else 3.9, height=4.2)
    for ax, (title, ylabel, settings, curves) in zip(axes, panels):
        shade_training(ax, train_len, n)
        for label, (color, runs, style) in curves.items():
            xs = list(range(1, len(runs[0]) + 1))
            ax.fill_between(xs, [min(c) for c in zip(*runs)], [max(c) for c in zip(*runs)],
                            color=color, alpha=0.3, lw=0, zorder=style.get("zorder", 2))
            ax.plot(xs, [mean(c) for c in zip(*runs)], color=color, label=label, **style)
        ax.set(title=title, ylabel=ylabel, **settings)
    if overlay:
        overlay(axes)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=ncol,
               fontsize=8)
    return fig


def norm_curves(runs, f, post_lw=2.5):
    """plot_panels' curves of f(metrics) per placement: post wide and on top."""
    return {n: (COLORS[n], [f(m) for m in ms], dict(lw=post_lw, zorder=5) if n == "post"
                else dict(zorder=3)) for n, ms in runs.items()}


# -------------------------------------------------------------------------------------- comparison
# python plots/lab.py --compare: every claim of the paper, 3 seeds each (plots/README.md, section 1)
def compare_grid(base, norms=tuple(NORMS), regimes=REGIMES, lrs=(None,), seeds=None):
    """Each placement in each regime (at each rate), COMPARE_SEEDS seeds; each run is evaluated
    with its raw, EMA and BEMA weights (averages never feed back: 'EMA off' is the raw run)."""
    seeds = [base.seed + i for i in range(COMPARE_SEEDS)] if seeds is None else seeds
    return [replace(base, norm=n, targets=t, lr_schedule=sch, lr=lr or base.lr, seed=s, ema=0.0)
            for t, sch in regimes for n in norms for lr in lrs for s in seeds]


def tune_rates(base, norms, regimes, lrs, device, runs_file=None):
    """Every rate on the first seed; the other seeds at the rate with the lowest training-length
    TVD (EMA weights). Returns (every run, wall, workers, {(norm, targets, schedule): rate})."""
    first, wall, workers = run_grid(compare_grid(base, norms, regimes, lrs, [base.seed]), device,
                                    later=len(norms) * len(regimes) * (COMPARE_SEEDS - 1),
                                    runs_file=runs_file)
    chosen = {}
    for c, r, _ in sorted(first, key=lambda d: summarize(d[1]["ema"], base.train_len)["tvd_train"]):
        chosen.setdefault((c.norm, c.targets, c.lr_schedule), c.lr)
    rest = [replace(c, seed=base.seed + i) for c, _, _ in first
            if c.lr == chosen[(c.norm, c.targets, c.lr_schedule)] for i in range(1, COMPARE_SEEDS)]
    more, wall2, _ = run_grid(rest, device, runs_file=runs_file)
    return first + more, wall + wall2, workers, chosen


def columns(L, v):
    """The comparison's columns, fixed before any run (plots/README.md, P1-P5): mean TVD on the
    training lengths; TVD at 1.5, 2, 4 L if s <= v - 1; mean TVD beyond L; TVD at s = v - 1."""
    cols = [("training lengths", lambda m: summarize(m, L)["tvd_train"])] + [
        (f"s = {s} ({r:g} L)", lambda m, s=s: m["tvd"][s - 1])
        for r, s in ((r, round(r * L)) for r in (1.5, 2, 4)) if L < s <= v - 1]
    return cols + [(f"mean, s = {L + 1}..{v - 1}", lambda m: summarize(m, L)["tvd_extrap"]),
                   (f"s = {v - 1}", lambda m: m["tvd"][-1])]


def crossover(post, rival):
    """The shortest length from which post's mean TVD stays below rival's; None if never."""
    a, b = ([mean(c) for c in zip(*[m["tvd"] for m in runs])] for runs in (post, rival))
    last = max((s for s in range(1, len(a) + 1) if a[s - 1] >= b[s - 1]), default=0)
    return last + 1 if last < len(a) else None


def compare_summary(rows, L, v, norms, regimes):
    """For compare.json: {regime: {norm: {avg: {column: [per seed]}}, 'crossover': {avg: s}}}."""
    out = {}
    for t, sch in regimes:
        r = out[f"{t}, {sch}"] = {}
        for norm in norms:
            r[norm] = {avg: {name: [f(m) for m in rows[(norm, t, sch, avg)]]
                             for name, f in columns(L, v)} for avg in AVERAGES}
        if {"post", "pre-final"} <= set(norms):
            r["crossover"] = {a: crossover(rows["post", t, sch, a], rows["pre-final", t, sch, a])
                              for a in AVERAGES}
    return out


def compare_table(summary, L, v, norms):
    """Markdown: the headline (placements x regimes, EMA weights), then every regime in full."""
    tested = [r for r in (2, 4) if r * L <= v - 1]   # 2 L, and 4 L where it is a test length
    cols = ["training lengths"] + [f"s = {r * L} ({r} L)" for r in tested]   # as in columns()
    regimes, names = list(summary), [name for name, _ in columns(L, v)]
    rows = [[f"`{norm}`"] + [" / ".join(f"{mean(summary[r][norm]['ema'][c]):.4f}" for c in cols)
                             for r in regimes] for norm in norms]
    if "post" in norms and "pre-final" in norms:
        rows.append(["`post` below `pre-final` from s ="] + [
            str(summary[r]["crossover"]["ema"] or "never") for r in regimes])
    out = ["### Headline: TVD on the training lengths / at " + " / at ".join(
        f"{r} L = {r * L}" for r in tested) + f" (EMA {COMPARE_EMA}, mean of {COMPARE_SEEDS} "
        "seeds)", ""] + md_table(["placement"] + regimes, rows)
    for r in regimes:
        rows = [[f"`{n}`", AVERAGE_LABELS[a], *(mean_sd(summary[r][n][a][c], 4) for c in names)]
                for n in norms for a in AVERAGES]
        out += ["", f"### {r} (TVD, mean +- sd over seeds)", ""] + md_table(
            ["placement", "weights"] + names, rows)
        if "crossover" in summary[r]:
            out += ["", "`post` below `pre-final` at every length from s = " + ", ".join(
                f"{summary[r]['crossover'][a] or 'never'} ({AVERAGE_LABELS[a]})"
                for a in AVERAGES) + "."]
    return out


def laws_table(rows, v):
    """theory.md's laws on the trained models (sampled targets, constant rate, EMA weights)."""
    says = {"pre": ("gap x s", "constant: the gap falls like 1/s"),
            "post": ("gap x sqrt(s (v-s)) / v",
                     "constant: the gap follows v / sqrt(s (v-s)), lowest at s = v/2")}
    runs = {n: rows[(n, "sampled", "constant", "ema")] for n in NORMS}
    span = lambda vals: [f"{min(vals):.3f}", f"{max(vals):.3f}"]  # noqa: E731
    table = [[f"`{n}`", *says[n], *span([g / law(s, v) for m in runs[n]
                                          for s, g in zip(m["length"], m["logit_gap"])])]
             for n, (_, law) in GAP_LAWS.items()]
    table += [[f"`{n}`", "attention entropy - log s", "0: uniform attention", *span(
        [h - u for m in runs[n] for h, u in zip(m["attn_entropy"], m["log_positions"])])]
        for n in ("pre", "pre-final", "post")]
    return ["### The laws of theory.md on the trained models (sampled, constant; EMA weights)",
            ""] + md_table(["norm", "quantity, over s = 1 .. v-1", "theory says", "min", "max"],
                           table)


def rates_table(done, chosen, L):
    """The rate sweep on the first seed: training-length TVD and TVD at 2 L, EMA weights."""
    seed = min(c.seed for c, _, _ in done)
    rows = [[f"{c.targets}, {c.lr_schedule}", f"`{c.norm}`", f"{c.lr:g}",
             f"{summarize(r['ema'], L)['tvd_train']:.4f}", f"{r['ema']['tvd'][2 * L - 1]:.4f}",
             "yes" if chosen[(c.norm, c.targets, c.lr_schedule)] == c.lr else ""]
            for c, r, _ in done if c.seed == seed]
    return ["### Learning rates (first seed, EMA weights; the chosen rate has the lowest TVD on "
            "the training lengths; the other seeds ran at it)", ""] + md_table(
        ["regime", "placement", "lr", "TVD, training lengths", "TVD at 2 L", "chosen"], rows)


def layer_entropy_table(rows, cfg, norms, regimes):
    """Attention entropy minus log(positions) per layer, EMA weights, mean of seeds (0: uniform)."""
    L, v = cfg.train_len, cfg.vocab
    at = sorted({L, 2 * L, v - 1} & set(range(1, v)))
    table = [[f"{t}, {sch}", f"`{norm}`", i] + [f"{x:.3f}" for x in (mean(
        [m[f"attn_entropy_layer{i}"][s - 1] - m["log_positions"][s - 1]
         for m in rows[(norm, t, sch, "ema")]]) for s in at)]
        for t, sch in regimes for norm in norms for i in range(1, cfg.n_layer + 1)]
    return ["### Attention entropy minus log(positions), per layer (EMA weights, mean of seeds; "
            "0 = uniform)", ""] + md_table(
        ["regime", "placement", "layer"] + [f"s = {s}" for s in at], table)


def plot_compare_norms(rows, cfg):
    """compare_norms.png, the README's first figure: sampled targets, constant rate, EMA weights."""
    L, v = cfg.train_len, cfg.vocab
    runs = {n: rows[(n, "sampled", "constant", "ema")]   # the remedy drawn last, on top
            for n in ("pre", "post-residual", "pre-final", "post")}
    curves = lambda f: norm_curves(runs, f, post_lw=3)  # noqa: E731
    gaps = {n: mean([m["logit_gap"][L - 1] for m in runs[n]]) for n in GAP_LAWS}
    return plot_panels([
        ("the logit gap: Pre-Norm's falls like 1/s", "unseen minus seen logit (log)",
         dict(yscale="log"), curves(lambda m: m["logit_gap"])),
        ("the error: TVD to the exact target", "TVD", dict(ylim=(0, 1)),
         curves(lambda m: m["tvd"])),
        ("attention: uniform but for post-residual", "attention entropy - log s (nats)",
         dict(ylim=(-0.3, 0.05)), curves(lambda m: [
             h - u for h, u in zip(m["attn_entropy"], m["log_positions"])]))],
        L, v - 1, ncol=6,
        overlay=lambda axes: draw_laws(axes[0], range(1, v), gaps, L, v, lw=1.2, zorder=6))


def plot_regimes(rows, cfg, norms, regimes):
    """compare_regimes.png: TVD per regime and placement (EMA weights), log scale."""
    return plot_panels([(f"{t} targets, {sch} lr", "TVD to the exact target (log)",
                         dict(yscale="log", ylim=(1e-4, 1)), norm_curves(
                             {n: rows[(n, t, sch, "ema")] for n in norms}, lambda m: m["tvd"]))
                        for t, sch in regimes], cfg.train_len, cfg.vocab - 1, ncol=len(norms) + 1)


def compare(base, out, command, norms=None, regimes=None, lrs=None, runs_file=None):
    """--compare: compare.md and .json, 2 figures (1 with norms or regimes); lrs: tune_rates."""
    full, device, chosen = norms is None and regimes is None, pick_device(base.device), {}
    norms, regimes = norms or tuple(NORMS), regimes or REGIMES
    if lrs and len(lrs) > 1:
        done, wall, workers, chosen = tune_rates(base, norms, regimes, lrs, device, runs_file)
    else:
        base = replace(base, lr=lrs[0]) if lrs else base
        done, wall, workers = run_grid(compare_grid(base, norms, regimes), device,
                                       runs_file=runs_file)
    rows = {}   # {(norm, targets, schedule, average): [metrics]}, at the chosen rates if tuned
    for c, result, _ in done:
        if chosen.get((c.norm, c.targets, c.lr_schedule), c.lr) == c.lr:
            for avg in AVERAGES:
                rows.setdefault((c.norm, c.targets, c.lr_schedule, avg), []).append(result[avg])
    L, v = base.train_len, base.vocab
    summary = compare_summary(rows, L, v, norms, regimes)
    lines = compare_table(summary, L, v, norms)
    figures = {"compare_regimes.png": plot_regimes(rows, base, norms, regimes)}
    record = dict(config=asdict(base), summary=summary)
    if full:
        lines += [""] + laws_table(rows, v)
        figures["compare_norms.png"] = plot_compare_norms(rows, base)
    if chosen:
        lines += [""] + rates_table(done, chosen, L)
        record["chosen_lr"] = {", ".join(k): lr for k, lr in chosen.items()}
    if base.n_layer > 1:
        lines += [""] + layer_entropy_table(rows, base, norms, regimes)
    lines += ["", f"Mean +- standard deviation over {COMPARE_SEEDS} seeds. "]
    details = (f"v={v}, train lengths 1..{L}, width {base.n_embd}, {base.n_layer} layer(s)"
               f"{', MLP' if base.mlp else ''}, {base.steps} steps, batch {base.batch_size}, "
               f"lr {'tuned' if chosen else base.lr}")
    finish(out, "compare", "\n".join(lines), command, details, figures, (done, wall, workers),
           runs_file, **record)


# ------------------------------------------------------------------------------------ alternatives
# python plots/lab.py --alternatives: would another remedy do as well? (theory.md, Appendix E)
ALTERNATIVES = {   # name: changes to the comparison's Pre-Norm setting
    "pre": {}, "pre + dropout 0.1": dict(dropout=0.1), "pre + dropout 0.3": dict(dropout=0.3),
    "pre + log-length scaling": dict(attn_scale="logn"), "pre + BOS": dict(bos=True),
    "post": dict(norm="post"), "post + BOS": dict(norm="post", bos=True)}


def alternatives_grid(base):   # each remedy on the comparison's Pre-Norm setting, 3 seeds
    sampled = dict(norm="pre", targets="sampled", lr_schedule="constant", ema=0.0)
    return [replace(base, **{**sampled, **changes}, seed=base.seed + i)
            for changes in ALTERNATIVES.values() for i in range(COMPARE_SEEDS)]


def plot_alternatives(named, cfg):
    """alternatives.png: every other remedy is dashed, so that equal curves stay visible."""
    colors = [f"tab:{c}" for c in ("red", "brown", "pink", "olive", "gray", "blue", "cyan")]
    styles = [dict(lw=4.5, zorder=1) if name == "pre" else
              dict(lw=3 if name.startswith("post") else 1.5, ls=("-", "--")[i % 2],
                   zorder=(5 if name.startswith("post") else 3) + i % 2)
              for i, name in enumerate(named)]
    curves = lambda f: {name: (c, [f(r["ema"]) for r in results], style)  # noqa: E731
                        for (name, results), c, style in zip(named.items(), colors, styles)}
    return plot_panels([
        ("the error, EMA weights", "TVD to the exact target", dict(ylim=(0, 1)),
         curves(lambda m: m["tvd"])),
        ("gap x s: flat = the 1/s law of dispersion", "logit gap x s", dict(yscale="log"),
         curves(lambda m: [g * s for s, g in zip(m["length"], m["logit_gap"])]))],
        cfg.train_len, cfg.vocab - 1)


def alternatives(base, out, command, runs_file=None):
    """The remedies side by side, 3 seeds each. Writes alternatives.md, .json and .png."""
    grid = run_grid(alternatives_grid(base), pick_device(base.device), ("ema",),
                    runs_file=runs_file)
    results, k = [r for _, r, _ in grid[0]], COMPARE_SEEDS   # in grid order: k seeds per remedy
    named = {name: results[i * k:i * k + k] for i, name in enumerate(ALTERNATIVES)}
    L, v, rows = base.train_len, base.vocab, []   # rows: each remedy, raw and EMA weights
    for name, avg in [(name, avg) for name in named for avg in ("raw", "ema")]:
        ms = [r[avg] for r in named[name]]
        gap_s = [mean([m["logit_gap"][s - 1] for m in ms]) * s for s in range(1, v)]
        rows.append([name, AVERAGE_LABELS[avg], *tvd_cells(ms, L),
                     f"{min(gap_s):.2f} - {max(gap_s):.2f}"])
    text = "\n".join(md_table(["remedy", "weight average", "TVD, training lengths",
                               "TVD, extrapolation", f"TVD at s = {v - 1}",
                               "gap x s, min - max over s (mean of seeds)"], rows))
    text += f"\n\nMean +- standard deviation over {COMPARE_SEEDS} seeds. "
    details = (f"v={v}, train lengths 1..{L}, {base.steps} steps, batch {base.batch_size}, "
               f"lr {base.lr}, sampled targets, constant learning rate")
    finish(out, "alternatives", text, command, details, {"alternatives.png": plot_alternatives(
        named, base)}, grid, runs_file, config=asdict(base))


# ------------------------------------------------------------------------------------------ search
# python plots/lab.py --search N: is the effect a property of the method or of the defaults?
SEARCH_N = 40            # the pre-registered size of the committed search (plots/README.md, 3)
SEARCH_DEFAULT = 4       # a reader's quick version: 12 runs, a few minutes on 2 cores
SEARCH_ARMS = ("pre", "pre-final", "post")   # trained from the same seed: paired
NO_LN2 = "pre, no MLP norm"                  # with --mlp, a fourth arm: pre without ln_2
SEARCH_THRESHOLDS = (0.05, 0.1, 0.2)         # training-length TVD, for the subgroups


def search_configs(n, seed, lrs=None, mlp=False):
    """n random configurations in the pre-registered ranges, once per arm from the same seed; with
    lrs, pre-final and post at every rate, in post's best corner (large batches, long runs); with
    mlp, 1-3 blocks with MLPs (layers drawn apart: the other draws stay as without) and NO_LN2."""
    g, layers, configs = random.Random(seed), random.Random(-1 - seed), []
    for i in range(n):
        v, heads = g.randint(16, 64), g.randint(1, 4)
        base = Config(vocab=v, train_len=g.randint(math.ceil(v / 4), (v - 1) // 2),
                      n_head=heads, n_embd=heads * math.ceil((2 * v - 2) / heads),
                      lr=round(10 ** g.uniform(math.log10(3e-4), -2), 6), seed=seed + i,
                      batch_size=round(2 ** g.uniform(6, 8)), steps=g.randint(1000, 4000))
        if lrs:
            base = replace(base, batch_size=g.randint(192, 256), steps=g.randint(4000, 8000))
        base = replace(base, mlp=True, n_layer=layers.randint(1, 3)) if mlp else base
        arms, rates = (("pre-final", "post"), lrs) if lrs else (SEARCH_ARMS, [base.lr])
        configs.append([replace(base, norm=arm, lr=lr) for arm in arms for lr in rates] +
                       [replace(base, mlp_norm=False)] * mlp)
    return configs


def arm(c):   # a search arm's name: its placement, and NO_LN2's missing MLP norm
    return c.norm if c.mlp_norm else NO_LN2


def reference(configs):   # the arm every other is paired against: the remedy, or with MLPs pre
    return "pre" if configs[0][0].mlp else "post"


def search_arms(runs, results):
    """{arm: (config, result)}: each arm at its rate with the lowest training TVD (EMA weights)."""
    train = lambda c: summarize(results[c]["ema"], c.train_len)["tvd_train"]  # noqa: E731
    return {a: (c, results[c]) for a in dict.fromkeys(map(arm, runs))   # in the runs' order
            for c in [min((c for c in runs if arm(c) == a), key=train)]}   # of equal: the first


def search_pairs(configs, results, rival, avg):
    """Per configuration: (log of rival / reference at 2 L, the pair's larger training TVD)."""
    out, ref = [], reference(configs)
    for runs in configs:
        L, m = runs[0].train_len, {a: r[avg] for a, (_, r) in search_arms(runs, results).items()}
        out.append((math.log(m[rival]["tvd"][2 * L - 1] / m[ref]["tvd"][2 * L - 1]),
                    max(summarize(m[k], L)["tvd_train"] for k in (rival, ref))))
    return out


def search_summary(configs, results):
    """The primary endpoint and every secondary one: {rival: {avg: {subgroup: stats}}}."""
    out, ref = {}, reference(configs)
    for rival in dict.fromkeys(a for a in ("pre-final", *map(arm, configs[0])) if a != ref):
        for avg in ("ema", "raw"):
            pairs = search_pairs(configs, results, rival, avg)
            out.setdefault(rival, {})[avg] = {"all": search_stats(pairs, ref), **{
                f"train TVD < {t}": search_stats([p for p in pairs if p[1] < t], ref)
                for t in SEARCH_THRESHOLDS}}
    return out


def search_losses(configs, results):
    """The reference's win rate (primary endpoint) at or below and above each setting's median."""
    ref, pairs = reference(configs), search_pairs(configs, results, "pre-final", "ema")
    runs = [search_arms(group, results)[ref][0] for group in configs]   # the reference's
    settings = {"v": lambda c: c.vocab, "L / v": lambda c: c.train_len / c.vocab,
                **({"layers": lambda c: c.n_layer} if configs[0][0].mlp else {}),
                "heads": lambda c: c.n_head, "lr": lambda c: c.lr,
                "batch": lambda c: c.batch_size, "steps": lambda c: c.steps}
    rows = []
    for name, get in settings.items():
        cut = statistics.median(get(c) for c in runs)
        wins = [[x > 0 for (x, _), c in zip(pairs, runs) if (get(c) <= cut) == below]
                for below in (True, False)]   # at or below the median, then above
        rows.append([name, f"{cut:.3g}"] + [f"{sum(w)} of {len(w)}" if w else "-" for w in wins])
    return md_table(["setting", "median", f"{ref} wins, at or below", "above"], rows)


def plot_search(configs, results, rivals):
    """search.png: the paired ratio at 2 L against the pair's training TVD, per rival."""
    fig, axes, ref = *new_figure(len(rivals)), reference(configs)
    for ax, rival in zip(axes, rivals):
        for avg, style in (("ema", dict(color="tab:blue", label=f"EMA {COMPARE_EMA}")),
                           ("raw", dict(color="0.5", mfc="none", label="raw weights"))):
            pairs = search_pairs(configs, results, rival, avg)
            ax.plot([t for _, t in pairs], [math.exp(x) for x, _ in pairs], "o", ms=5, **style)
        ax.axhline(1, color="k", lw=1, ls="--")
        for t in SEARCH_THRESHOLDS:
            ax.axvline(t, color="0.7", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="training-length TVD (worse of the pair)",
               ylabel=f"TVD at 2 L: {rival} / {ref}", title=f"above 1: {ref} beats {rival}")
        for axis, ticks in ((ax.xaxis, (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)),
                            (ax.yaxis, (0.5, 1, 2, 5, 10))):   # plain numbers, no overlap
            lo, hi = axis.get_view_interval()
            shown = [t for t in ticks if lo <= t <= hi]
            axis.set_ticks(shown, labels=[f"{t:g}" for t in shown])
            axis.set_ticks([], minor=True)
        ax.legend(fontsize=8)
    return fig


def search_text(configs, results, n, lrs):
    """search.md's body: the primary endpoint, every endpoint, the splits, every configuration."""
    h, ref, mlp = search_summary(configs, results), reference(configs), configs[0][0].mlp
    p = h["pre-final"]["ema"]["all"]
    fmt = lambda st: ("no configuration" if st["n"] == 0 else  # noqa: E731
                      f"{st[ref + '_wins']} of {st['n']} ({st['win_rate_95'][0]:.2f} - "
                      f"{st['win_rate_95'][1]:.2f}) | {st['sign_p']:.3g} | "
                      f"{st['wilcoxon_p']:.3g} | {st['median_ratio']:.2f} "
                      f"({st['median_ratio_95'][0]:.2f} - {st['median_ratio_95'][1]:.2f})")
    lines = md_table(["rival", "weights", "configurations", f"{ref} wins (95 % interval)",
                      "sign test p", "Wilcoxon p", f"median ratio rival / {ref} (95 % bootstrap)"],
                     [[f"`{rival}`", AVERAGE_LABELS[avg], group, fmt(st)]
                      for rival in h for avg in ("ema", "raw")
                      for group, st in h[rival][avg].items() if st["n"]])
    arms, rows, lowest = list(search_arms(configs[0], results)), [], []
    for i, runs in enumerate(configs):
        best, L = search_arms(runs, results), runs[0].train_len
        c, at = best[ref][0], {a: r["ema"]["tvd"][2 * L - 1] for a, (_, r) in best.items()}
        cells = [f"{summarize(r['ema'], L)['tvd_train']:.3f}, {at[a]:.3f}" +
                 (f" (lr {run.lr:g})" if lrs else "") for a, (run, r) in best.items()]
        lowest.append(min(arms, key=at.get))   # reported with MLPs
        win = "yes" if at["pre-final"] > at[ref] else "no"
        rows.append([i, c.vocab, L, *[c.n_layer] * mlp, c.n_head, c.n_embd, "tuned" if lrs
                     else f"{c.lr:.2g}", c.batch_size, c.steps, *cells, win])
    configurations = md_table(["#", "v", "L", *["layers"] * mlp, "heads", "width", "lr", "batch",
                               "steps"] + [f"{a}: train, 2 L" for a in arms] +
                              [f"{ref} beats pre-final"], rows)
    return h, (
        f"Primary endpoint (EMA {COMPARE_EMA} weights, all {n} configurations): the TVD at "
        f"twice the longest training length was lower with `{ref}` than with `pre-final` in "
        f"{fmt(p).split(' |')[0]}; two-sided sign test p = {p['sign_p']:.3g}, Wilcoxon "
        f"p = {p['wilcoxon_p']:.3g}; median ratio pre-final / {ref} "
        f"{p['median_ratio']:.2f} (95 % bootstrap interval {p['median_ratio_95'][0]:.2f} - "
        f"{p['median_ratio_95'][1]:.2f})." + ("\n\nLowest at 2 L (EMA weights): " + ", ".join(
            f"`{a}` in {lowest.count(a)} of {n}" for a in arms) + "." if mlp else "") + "\n\n"
        "### Every endpoint, overall and by training TVD\n\n" + "\n".join(lines) +
        f"\n\n### Where {ref} wins against pre-final (primary endpoint, split at each setting's "
        "median; exploratory)\n\n" + "\n".join(search_losses(configs, results)) +
        "\n\n### Every configuration (EMA weights)\n\n" + "\n".join(configurations))


def search(base, out, n, command, lrs=None, runs_file=None):
    """python plots/lab.py --search N: N random configurations, one run per arm (and rate)."""
    configs = search_configs(n, base.seed, lrs, base.mlp)
    grid = run_grid(sum(configs, []), pick_device(base.device), ("ema",), runs_file=runs_file)
    results = {c: r for c, r, _ in grid[0]}
    summary, text = search_text(configs, results, n, lrs)
    details = f"seed {base.seed}; ranges in `search_configs`; protocol in plots/README.md"
    finish(out, "search", text + "\n\n", command, details, {"search.png": plot_search(
        configs, results, list(summary))}, grid, runs_file, summary=summary)


# ---------------------------------------------------------------------------------- language suite
# python plots/lab.py --suite: do the remedies carry over? (plots/README.md, section 7)
SUITE_LANGUAGES = (dict(task="dyck", brackets=2, max_depth=4), dict(task="shuffle", brackets=2))
# Counting and matching brackets need more than a bag of tokens: two layers (the second reads
# what the first computed at every position), an MLP to read counts, and a BOS token, whose share
# of uniform attention, 1 / (t + 1), tells the model how long its prefix is (theory.md, App. D).
SUITE_MODEL = dict(train_len=16, n_layer=2, n_head=1, n_embd=32, mlp=True, bos=True, dropout=0.0,
                   steps=3000, batch_size=128, lr=1e-3, lr_schedule="constant", targets="sampled")
SUITE_NORMS, SUITE_SEEDS = ("pre", "pre-final", "post"), 5


def suite_grid(base, **overrides):   # every language x SUITE_NORMS x SUITE_SEEDS seeds
    settings = {**SUITE_MODEL, **overrides, "ema": 0.0}
    return [make_task(replace(base, **settings, **lang, norm=norm, seed=base.seed + i)).cfg
            for lang in SUITE_LANGUAGES for norm in SUITE_NORMS for i in range(SUITE_SEEDS)]


def suite_table(groups, L):
    """suite.md's body: each language and placement; each rival minus post, paired by seed."""
    rows = [[name, f"`{norm}`", AVERAGE_LABELS[avg], *tvd_cells(ms, L),
             mean_sd([mean(m["invalid_mass"][L:]) for m in ms])]
            for (name, norm), results in groups.items() for avg in ("raw", "ema")
            for ms in [[r[avg] for r in results]]]
    ext = {k: [summarize(r["ema"], L)["tvd_extrap"] for r in rs] for k, rs in groups.items()}
    pairs = []
    for (name, rival), xs in ext.items():
        if rival != "post":
            d = [x - y for x, y in zip(xs, ext[name, "post"])]
            m, lo, hi = mean_interval(d)
            pairs.append([name, f"`{rival}` - `post`", ", ".join(f"{x:+.3f}" for x in d),
                          f"{m:+.4f} ({lo:+.4f} to {hi:+.4f})", "no" if lo <= 0 <= hi else "yes"])
    return "\n".join(md_table(["language", "norm", "weight average", "TVD, training lengths",
                               "TVD, extrapolation", "TVD at the longest length",
                               "invalid mass, extrapolation"], rows) + [
        "", f"Mean +- standard deviation over {SUITE_SEEDS} seeds.", "",
        "### Paired by seed: each placement minus `post` (positive: `post` is lower)", ""] +
        md_table(["language", "difference (EMA weights, extrapolation TVD)", "per seed",
                  "mean (95 % t interval)", "distinguishable from seed noise"], pairs) + ["", ""])


def plot_suite(groups, L):
    """suite.png: TVD against position per language and placement (EMA weights)."""
    return plot_panels([(name, "TVD to the exact next-token distribution", dict(xlabel="position"),
                         {norm: (COLORS[norm], [r["ema"]["tvd"] for r in groups[name, norm]],
                                 dict(lw=2)) for norm in SUITE_NORMS})
                        for name in dict.fromkeys(name for name, _ in groups)], L, 4 * L)


def suite(base, out, command, runs_file=None, **overrides):
    """python plots/lab.py --suite: the languages, then suite.md, suite.json, suite.png."""
    grid = run_grid(suite_grid(base, **overrides), pick_device(base.device), runs_file=runs_file)
    groups, L = {}, grid[0][0][0].train_len   # {(language, norm): [each seed's result]}, grid order
    for c, r, _ in grid[0]:
        groups.setdefault((make_task(c).name, c.norm), []).append(r)
    settings = ", ".join(f"{k} {v}" for k, v in {**SUITE_MODEL, **overrides}.items())
    finish(out, "suite", suite_table(groups, L), command, settings,
           {"suite.png": plot_suite(groups, L)}, grid, runs_file)


# ------------------------------------------------------------------------------------------ theory
# python plots/lab.py --theory: Part 1's hand-built models against their formulas
def predicted_margin(vocab, norm, s, gamma=1.0, eps=1e-5):
    """hand_built's unseen minus seen logit at length s (theory.md, 2, 4, C): the values' average
    u_bar = 1_t / s - 1/v differs by 1/s; each LayerNorm divides it by the spread it sees."""
    n = 2 * vocab
    var_1 = (n - 1) / n**2 + eps   # the input LN (pre, pre-final) sees one token e_(v+x)
    if norm == "pre":
        return gamma / (s * math.sqrt(var_1))
    if norm == "pre-final":        # the final LN sees that token plus u_bar / sqrt(var_1)
        var_f = (1 + (1 / s - 1 / vocab) / var_1) / n - 1 / n**2
        return gamma / (s * math.sqrt(var_1) * math.sqrt(var_f + eps))
    var = {"post": (1 / s - 1 / vocab) / n,                                 # u_bar alone: shrinks
           "post-residual": (1 + 1 / s - 1 / vocab) / n - 1 / n**2}[norm]   # token + u_bar
    return gamma / (s * math.sqrt(var + eps))


def predicted_tvd(vocab, s, margin):
    """theory.md's TVD of balanced logits of margin m, s / (s + (v - s) e^m), without overflow."""
    return 1 / (1 + (vocab - s) / s * math.exp(min(margin, 700)))


def theory(vocab, train_len, out):
    """The hand-built models against their formulas, each of margin 6 at s = L; theory.png."""
    print(f"hand-built models, v={vocab}, each scaled to margin 6 at s={train_len}: evaluate() on "
          "the script's own Transformer, in float64, against theory.md's formulas")
    fig, (ax1, ax2) = new_figure(2, height=4.4)
    for norm in NORMS:
        gamma = 6.0 / predicted_margin(vocab, norm, train_len)
        m = evaluate(hand_built(vocab, norm, gamma), n_perm=200)
        s, c = m["length"], COLORS[norm]
        pred_m = [predicted_margin(vocab, norm, x, gamma) for x in s]
        print(f"{norm:14s} margin {pred_m[0]:.3f} at s = 1, {pred_m[-1]:.3f} at s = {vocab - 1}; "
              f"largest relative difference from the model "
              f"{max(abs(g / p - 1) for g, p in zip(m['logit_gap'], pred_m)):.1e}")
        ax1.plot(s, pred_m, color=c, label=f"{norm}: formula")
        ax1.plot(s, m["logit_gap"], "o", color=c, ms=3, label=f"{norm}: model")
        ax2.semilogy(s, [predicted_tvd(vocab, x, pm) for x, pm in zip(s, pred_m)], color=c)
        ax2.semilogy(s, [max(t, 1e-12) for t in m["tvd"]], "o", color=c, ms=3)
    for ax in (ax1, ax2):
        shade_training(ax, train_len, vocab - 1, label=None)
    ax1.set(ylabel="margin: unseen minus seen logit",
            title="hand-built margins (theory.md 2, 4, App. C)")
    ax2.set(ylabel="TVD (equal to the invalid mass)", title="hand-built TVD", ylim=(1e-9, 1.5))
    fig.legend(*ax1.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(f"hand-built models, v = {vocab}: each readout scale gamma chosen so that the "
                 f"margin is 6 at s = {train_len} (the longest training length)", fontsize=10)
    print(f"wrote {', '.join(write_outputs(out, {'theory.png': fig}))}")


# -------------------------------------------------------- tables from grids already run (--tables)
def depth_records(root):   # root/depthN/**/compare.json, not a copy such as depth1-old
    return [p for p in sorted(Path(root).glob("depth*/**/compare.json"))
            if re.fullmatch(r"depth\d+", p.relative_to(root).parts[0])]


def check_tables(root, out, bad):
    """--tables ROOT: the --compare records depth_sweep and mlp_norm_table read; --out's folder."""
    if not os.path.isdir(root) or not (depths := depth_records(root)):
        bad(f"--tables {root}: no depthN/compare.json in it (ROOT holds the depth grids' --out "
            "folders depth1, depth2, ..., as plots/ does)")
    ablations = sorted(Path(root).glob("mlp_norm/layers*/compare.json"))
    pairs = ablations + [Path(root, f"depth{p.parent.name[6:]}", "compare.json") for p in ablations]
    norms = set()
    for p in depths + pairs:
        try:
            rec = json.loads(p.read_text("utf-8"))
        except (OSError, ValueError):
            rec = None
        if not (isinstance(rec, dict) and {"config", "summary", "runs"} <= set(rec)):
            bad(f"--tables {root}: {p} is not a record of python plots/lab.py --compare")
        if p in pairs and "chosen_lr" not in rec:
            bad(f"--tables {root}: {p} is a grid without --lrs; mlp_norm.md compares chosen rates")
        norms |= {n for ns in rec["summary"].values() for n in ns} if p in depths else set()
    if len(norms) < 2:
        bad(f"--tables {root}: its depth grids hold one placement ({', '.join(norms)}); depth.md "
            "compares two or more")
    if os.path.isfile(os.path.join(out or "runs", "mlp_norm")):
        bad(f"--out {out}: mlp_norm there is a file, where --tables writes a folder")


def depth_sweep(root, out=None):
    """OUT/depth.md and .png (OUT: root) from root/depthN/**/compare.json: each placement's TVD
    against depth (EMA, chosen rates), seed noise at 2 L (P10); each first seed at every rate."""
    pool, rates = {}, {}   # (layers, regime, norm, column): each seed's; (layers, regime, lr): ...
    for p in depth_records(root):
        top = p.relative_to(root).parts[0]
        d, rec = int(top[5:]), json.loads(p.read_text("utf-8"))
        for r, ns in rec["summary"].items():
            for n, c, v in [(n, c, v) for n in NORMS if n in ns for c, v in ns[n]["ema"].items()]:
                pool.setdefault((d, r, n, c.split("(")[-1].rstrip(")")), []).extend(v)
        for c, m in [(config(x["config"]), x["ema"]) for x in rec["runs"]]:
            if p.parent.name == top and "chosen_lr" in rec and c.seed == rec["config"]["seed"]:
                regime = f"{c.targets}, {c.lr_schedule}"   # {norm: (TVD at 2 L, chosen)}
                rates.setdefault((d, regime, c.lr), {})[c.norm] = (m["tvd"][2 * c.train_len - 1], (
                    "*" if rec["chosen_lr"][f"{c.norm}, {regime}"] == c.lr else ""))
    depths, first = sorted({k[0] for k in pool}), list(dict.fromkeys(k[1] for k in pool))
    norms = [n for n in NORMS if n in {k[2] for k in pool}]
    whole = [(d, r) for d in depths for r in first if all((d, r, n, "2 L") in pool for n in norms)]
    if left := [f"{d} layers, {r}" for d in depths for r in first if (d, r) not in whole]:
        print(f"depth_sweep: not every placement in {'; '.join(left)}: left out")
    rows = []
    for d, r in whole:
        at, fit = ({n: pool[d, r, n, c] for n in norms} for c in ("2 L", "training lengths"))
        best, runner = sorted(norms, key=lambda n: mean(at[n]))[:2]
        apart = all(max(at[best]) < min(at[n]) for n in norms if n != best)
        worse = [f"`{n}`" for n in norms if mean(fit[n]) > 2 * min(map(mean, fit.values()))]
        rows.append([d, r, len(at[best])] + [f"{mean(fit[n]):.4f} / {mean(at[n]):.4f} ("
                    f"{min(at[n]):.3f} - {max(at[n]):.3f})" for n in norms] + [f"`{best}`",
                    "outside" if apart else "within", "{:+.3f} ({:+.3f} to {:+.3f})".format(
                        *mean_interval([a - b for a, b in zip(at[best], at[runner])])),
                    ", ".join(worse) or "-"])
    by_rate = [[d, r, f"{lr:g}"] + [f"{t[n][0]:.4f}{t[n][1]}" if n in t else "-" for n in norms] +
               [f"`{min(t, key=t.get)}`"] for (d, r, lr), t in sorted(
                   rates.items(), key=lambda kv: (kv[0][0], first.index(kv[0][1]), kv[0][2]))]
    text = "\n".join(["Training-length TVD / TVD at 2 L (seeds' min - max), EMA 0.999, chosen "
                      "rates; fits worse: training TVD over twice the best.", ""] + md_table(
        ["layers", "regime", "seeds"] + [f"`{n}`" for n in norms] + ["lowest at 2 L", "seed noise",
                                  "lowest - next at 2 L, paired (95 % t)", "fits worse"], rows) + [
        "", "Each rate on each grid's first seed (seed 0): TVD at 2 L, EMA 0.999 (* the rate "
        "chosen, by the training-length TVD); who is lowest at each rate.", ""] + md_table(
        ["layers", "regime", "lr"] + [f"`{n}`" for n in norms] + ["lowest at 2 L"], by_rate))
    print(text)
    write_outputs(out or root, {"depth.md": text + "\n",
                                  "depth.png": plot_depth(pool, whole, depths, first, norms)})


def plot_depth(pool, whole, depths, first, norms):
    """depth.png: each placement's TVD against depth, at 2 L and on the training lengths."""
    fig, axes = new_figure(2 * len(first), width=3.6)
    for ax, (c, r) in zip(axes, [(c, r) for c in ("2 L", "training lengths") for r in first]):
        ds = [d for d in depths if (d, r) in whole]
        for n in norms:
            ys = [pool[d, r, n, c] for d in ds]
            ax.plot(ds, [mean(y) for y in ys], color=COLORS[n], label=n)
            ax.plot([d for d, y in zip(ds, ys) for _ in y], sum(ys, []), "o", ms=4, color=COLORS[n])
        ax.set(title=f"{r}: TVD, {c}", xlabel="layers", yscale="log", xticks=depths)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3)
    return fig


def mlp_norm_table(root, out=None):
    """OUT/mlp_norm.md (OUT: root/mlp_norm): pre with its MLP norm (root/depthN) and without it
    (root/mlp_norm/layersN), chosen rates, EMA weights: TVD, logit gap x s at L and 2 L (P11)."""
    group = {}   # (layers, regime, MLP norm): (metrics, L) of each seed at the chosen rate
    for p in sorted(Path(root).glob("mlp_norm/layers*/compare.json")):
        for normed, q in (("yes", Path(root, f"depth{p.parent.name[6:]}/compare.json")), ("no", p)):
            rec = json.loads(q.read_text("utf-8"))
            for c, m in [(config(r["config"]), r["ema"]) for r in rec["runs"]]:
                regime = f"{c.targets}, {c.lr_schedule}"
                if c.norm == "pre" and rec["chosen_lr"][f"pre, {regime}"] == c.lr:
                    group.setdefault((c.n_layer, regime, normed), []).append((m, c.train_len))
    other = lambda k: (*k[:2], "no" if k[2] == "yes" else "yes")  # noqa: E731  the other arm
    if left := sorted({f"{k[0]} layer(s), {k[1]}" for k in group if other(k) not in group}):
        print(f"mlp_norm_table: one arm only in {'; '.join(left)}: left out")
    if not (group := {k: ms for k, ms in group.items() if other(k) in group}):
        return
    at = {k: [m["tvd"][2 * L - 1] for m, L in ms] for k, ms in group.items()}
    fit = {k: mean([summarize(m, L)["tvd_train"] for m, L in ms]) for k, ms in group.items()}
    rows = []
    for k in sorted(group, key=lambda k: (k[0], k[1][0] == "e", k[2] == "no")):  # sampled first
        ms, L, o = group[k], group[k][0][1], other(k)
        gs = [mean([m["logit_gap"][s - 1] * s for m, _ in ms]) for s in (L, 2 * L)]
        rows.append([*k, f"{fit[k]:.4f} / {mean(at[k]):.4f} ({min(at[k]):.3f} - {max(at[k]):.3f})",
                     ("outside" if max(at[k]) < min(at[o]) or min(at[k]) > max(at[o]) else "within")
                     + ("; fits worse (P11)" if fit[k] > 2 * fit[o] else ""),
                     f"{gs[0]:.2f}", f"{gs[1]:.2f}", f"{gs[1] / gs[0]:.2f}"])
    text = "\n".join(["`pre` with and without its MLP norm: training-length TVD / TVD at 2 L "
                      "(seeds' min - max), EMA 0.999, chosen rates; seed noise at 2 L against "
                      "the other arm (fits worse: training-length TVD over twice its); logit gap "
                      "x s, mean of seeds; rho = its ratio, 2 L over L.",
                      ""] + md_table(["layers", "regime", "MLP norm", "`pre`", "seed noise",
                                      "gap x s at L", "gap x s at 2 L", "rho"], rows))
    print(text)
    layers = sorted({k[0] for k in group})
    fig, axes = new_figure(2, 5, 3.6, len(layers))   # a row per depth: gap x s, then the TVD
    for k, ms in sorted(group.items()):   # mean of seeds; dashed: without the MLP norm
        s, d = range(1, len(ms[0][0]["tvd"]) + 1), 2 * layers.index(k[0])
        for ax, key in zip(axes[d:d + 2], ("logit_gap", "tvd")):
            ax.plot(s, [mean([m[key][j - 1] * (j if key == "logit_gap" else 1) for m, _ in ms])
                        for j in s], "--" if k[2] == "no" else "-", color="C1" if k[1][0] == "s"
                    else "C0", label=f"{k[1]}, MLP norm: {k[2]}")
            ax.set(title=f"{k[0]} layer(s)", ylabel=("logit gap x s" if key == "logit_gap" else
                                                    "TVD") + " (EMA, mean of seeds)")
    for ax in axes:
        shade_training(ax, ms[0][1], len(s))
    axes[0].legend(fontsize=7)
    fig.suptitle("pre with an MLP, with and without its MLP norm")
    write_outputs(out or os.path.join(root, "mlp_norm"), {"mlp_norm.md": text, "mlp_norm.png": fig})


# ------------------------------------------------------------------------------------ command line
def comma_list(item, ok, wants):
    """An argparse type: distinct items separated by commas, each item(text) and ok(item)."""
    def parse(text):
        try:
            xs = tuple(map(item, text.split(",")))
        except ValueError:
            xs = ()
        if not (xs and all(map(ok, xs)) and len(set(xs)) == len(xs)):   # nan is not ok
            raise argparse.ArgumentTypeError(f"{wants}, got {text}")
        return xs
    return parse


MODEL_FLAGS = {"vocab", "train_len", "n_layer", "n_head", "n_embd", "mlp", "mlp_norm", "bos",
               "attn_scale", "steps", "batch_size", "lr"}
MODE_FLAGS = {   # the flags each mode takes, besides --seed, --device and --out
    "compare": MODEL_FLAGS | {"lrs", "norms", "regimes", "resume"},
    "alternatives": MODEL_FLAGS - {"bos", "attn_scale"} | {"resume"},
    "search": {"lrs", "mlp", "resume"}, "suite": set(SUITE_MODEL) | {"resume"},
    "theory": {"vocab", "train_len"}, "tables": set()}
GRIDS = ("compare", "alternatives", "search", "suite")   # the modes that train
LIMITS = {**R.LIMITS, "search": (1, 100), "seed": (0, 2**32 - SUITE_SEEDS)}
FLAGS = [f for f in R.FLAGS if f[0] not in {"--norm", "--post-norm", "--ema", "--save",
                                            "--handout"}] + [   # those are resharpen.py's alone
    ("--no-mlp-norm", dict(action="store_const", dest="mlp_norm", const=False), "with --mlp, drop "
     "the block's own MLP norm ln_2: every placement adds x + MLP(x)"),
    ("--attn-scale", list(ATTENTIONS), "logn: scores times s_h log(n) (Scalable-Softmax)"),
    ("--lrs", comma_list(float, lambda x: 0 < x <= 1, "distinct rates in (0, 1] separated by "
                         "commas (such as 0.001,0.01)"),
     "--compare, --search: every rate, the best fit kept"),
    ("--norms", comma_list(str, NORMS.__contains__, f"each of {', '.join(NORMS)} at most once"),
     "--compare: only these placements"),
    ("--regimes", comma_list(lambda x: tuple(x.split("/")), REGIMES.__contains__, "each of "
                             f"{', '.join(map('/'.join, REGIMES))} at most once"),
     "--compare: only these, such as sampled/constant"),
    ("--resume", bool, "a grid: keep the runs an interrupted command left in OUT/MODE.runs.jsonl"),
    ("--compare", bool, f"mode: every placement x targets x schedule, {COMPARE_SEEDS} seeds"),
    ("--alternatives", bool, "mode: Pre-Norm with dropout, log-length scaling or BOS, and post"),
    ("--suite", bool, f"mode: the formal languages, {SUITE_SEEDS} seeds, own settings (flags "
     "override)"),
    ("--search", dict(type=int, nargs="?", const=SEARCH_DEFAULT, metavar="N"), "mode: paired "
     f"random search, N configurations (default {SEARCH_DEFAULT}; the committed one: {SEARCH_N})"),
    ("--theory", bool, "mode: theory.md's hand-built models against their formulas"),
    ("--tables", dict(metavar="ROOT"), "mode: depth.md and mlp_norm/mlp_norm.md (and figures) "
     "from the grids in ROOT/depthN and ROOT/mlp_norm/layersN"),
]


def check_args(args, parser):
    """Refuse bad input before training (exit 2, naming the flag): (mode, cfg, suite_flags)."""
    bad, given = parser.error, {k for k, v in vars(args).items() if v is not None}
    if not (mode := next((m for m in MODE_FLAGS if m in given), None)):
        bad(f"give one mode: {', '.join('--' + m for m in MODE_FLAGS)} "
            "(python plots/lab.py --help)")
    if extra := given - MODE_FLAGS[mode] - {mode, "seed", "device", "out"}:
        names = ("--no-mlp-norm" if x == "mlp_norm" else "--" + x.replace("_", "-") for x in extra)
        bad(f"{', '.join(sorted(names))}: not used by --{mode} (python plots/lab.py --help)")
    R.check_ranges(args, bad, LIMITS)
    cfg = Config(**{k: getattr(args, k) for k in given if k in Config.__dataclass_fields__})
    if not (cfg.mlp or cfg.mlp_norm):
        bad("--no-mlp-norm: there is no MLP norm to drop without --mlp")
    if mode == "search" and cfg.mlp and args.lrs:
        bad("--lrs: --search --mlp trains every arm at its configuration's one drawn rate")
    top, why = {"compare": ((cfg.vocab - 1) // 2, "--compare tests 2 x --train-len"),
                "alternatives": (cfg.vocab - 2, "it needs a longer length"),
                "suite": (256, "a language's limit")}.get(mode, (cfg.vocab - 1, "v - 1"))
    if mode != "search" and cfg.train_len > top:
        bad(f"--train-len must be at most {top} ({why}), got {cfg.train_len}")
    if mode == "tables":
        check_tables(args.tables, args.out, bad)
    if mode == "theory" and cfg.vocab > 256:
        bad(f"--vocab: --theory builds float64 models of width 2v, at most 256; got {cfg.vocab}")
    suite_flags = {k: getattr(args, k) for k in given & set(SUITE_MODEL)}
    runs = {   # every configuration the command will train (--compare --lrs: every rate, seed)
        "compare": lambda: compare_grid(cfg, args.norms or tuple(NORMS), args.regimes or REGIMES,
                                        args.lrs or (None,)),
        "suite": lambda: suite_grid(cfg, **suite_flags),
        "search": lambda: sum(search_configs(args.search, cfg.seed, args.lrs, cfg.mlp), []),
        "alternatives": lambda: alternatives_grid(cfg)}.get(mode, list)()
    device = pick_device(cfg.device)
    R.check_model(runs or [cfg], grid_workers(runs, device), bad,
                  4 * runs[0].train_len if mode == "suite" else None)
    R.check_out(args.out, bad)
    if mode in GRIDS:
        path = os.path.join(os.path.abspath(args.out or "runs"), f"{mode}.runs.jsonl")
        check_runs_file(path, runs, device, mode, args.resume, bad)
    return mode, cfg, suite_flags


def main(argv=None):
    """The lab's command line; exit status as resharpen.py's."""
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ["MPLBACKEND"] = "agg"   # figures are drawn off screen
    parser = R.build_parser(FLAGS, [{f"--{m}" for m in MODE_FLAGS}], __doc__, "--norms")
    mode, cfg, suite_flags = check_args(args := parser.parse_args(argv), parser)
    out = args.out or "runs"
    shown = [a for i, a in enumerate(argv) if not (a in ("--out", "--resume") or a.startswith(
        "--out=") or i and argv[i - 1] == "--out")]   # what changes no number
    command = shlex.join(["python", "plots/lab.py"] + shown)   # for the tables
    runs = RunsFile(os.path.join(out, f"{mode}.runs.jsonl")) if mode in GRIDS else None
    run = {"theory": lambda: theory(cfg.vocab, cfg.train_len, out),
           "tables": lambda: (depth_sweep(args.tables, out),   # and mlp_norm/ if it is there
                              mlp_norm_table(args.tables, os.path.join(out, "mlp_norm"))),
           "compare": lambda: compare(cfg, out, command, args.norms, args.regimes, args.lrs, runs),
           "suite": lambda: suite(cfg, out, command, runs, **suite_flags),
           "alternatives": lambda: alternatives(cfg, out, command, runs),
           "search": lambda: search(cfg, out, args.search, command, args.lrs, runs)}[mode]
    kept = {130: "; the same command with --resume keeps the finished runs",
            1: f" The finished runs are in {runs and runs.path}."}
    R.stop(run, "lab.py", lambda code: kept[code] if runs and os.path.exists(runs.path) else
           " Nothing was written." * (code == 1))


if __name__ == "__main__":
    main()
