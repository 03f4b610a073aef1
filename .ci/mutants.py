"""Mutation run: plausible one-line bugs of resharpen.py and plots/lab.py, each applied to a copy
of the working tree; the suite (python -m pytest -x -q) should fail on every one. Not run by CI:
    python .ci/mutants.py              # every mutant; prints caught / MISSED per mutant, then counts
    python .ci/mutants.py 3 17         # only these (numbers as printed)
Each mutant is (file, old text, new text); old text must occur exactly once in the file."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

R, LAB = "resharpen.py", "plots/lab.py"
MUTANTS = [
    # resharpen.py: the task
    (R, "unseen / unseen.sum(dim=-1, keepdim=True)", "unseen / (unseen.sum(dim=-1, keepdim=True) + 1)"),
    (R, "math.log(self.vocab - s) for s", "math.log(self.vocab - s + 1) for s"),
    (R, "range(1, self.train_len + 1)) / self.train_len", "range(1, self.train_len)) / self.train_len"),
    (R, "EVAL_SEED = 1234 ", "EVAL_SEED = 4321 "),
    (R, "EVAL_PERMS = 1000 ", "EVAL_PERMS = 500 "),
    # the model
    (R, "/ math.sqrt(q.shape[-1])", "/ q.shape[-1]"),
    (R, "dtype=torch.bool, device=x.device).tril()", "dtype=torch.bool, device=x.device).tril(1)"),
    (R, "y = self.drop(att) @ v ", "y = self.drop(att).detach() @ v "),
    (R, "x = x + self.ln_1(self.drop(a))", "x = self.ln_1(x + self.drop(a))"),
    (R, "a, att = self.attn(self.ln_1(x))", "a, att = self.attn(x)"),
    (R, "nn.init.normal_(p, mean=0.0, std=0.02)", "nn.init.normal_(p, mean=0.0, std=0.03)"),
    (R, "logits = self.lm_head(self.ln_f(x))", "logits = self.lm_head(x)"),
    (R, "self.ln_1 = nn.LayerNorm(cfg.n_embd)", "self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-6)"),
    # the EMA
    (R, "return (1 - self.decay) / (1 - self.decay**t)", "return 1 - self.decay"),
    (R, "        self.t += 1\n", "        self.t = 1\n"),
    (R, "avg.lerp_(p, beta)", "avg.lerp_(p, 1 - beta)"),
    (R, "        p.copy_(a)\n    return model", "        p.copy_((a + p) / 2)\n    return model"),
    # training
    (R, "math.cos(math.pi * (step - 1) /", "math.cos(math.pi * step /"),
    (R, "torch.manual_seed(cfg.seed)  ", "torch.manual_seed(cfg.seed + 1)  "),
    (R, "gen = torch.Generator().manual_seed(cfg.seed)", "gen = torch.Generator().manual_seed(cfg.seed + 1)"),
    (R, "AdamW(model.parameters(), lr=cfg.lr)", "AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)"),
    (R, "task.sample(cfg.batch_size, cfg.train_len + 1, gen)", "task.sample(cfg.batch_size, cfg.train_len, gen)"),
    (R, "loss = -(task.target(x) * logp).sum(-1).mean()", "loss = -(task.target(x) * logp).mean()"),
    (R, "y.reshape(-1))", "y.reshape(-1), reduction='sum') / cfg.batch_size"),
    (R, "recent = losses[-every:]", "recent = losses[-every + 1:]"),
    (R, "{sum(recent) / len(recent):.4f}", "{sum(recent) / every:.4f}"),
    (R, "        opt.step()\n        for avg in averages:\n            avg.update(model)\n",
        "        for avg in averages:\n            avg.update(model)\n        opt.step()\n"),
    (R, "opt.zero_grad(set_to_none=True)\n        loss.backward()", "loss.backward()\n        opt.zero_grad(set_to_none=True)"),
    # evaluation
    (R, "tvd = (q - p).clamp_min(0).sum(-1)", "tvd = (q - p).abs().sum(-1)"),
    (R, "invalid = (q * seen).sum(-1)", "invalid = (q * seen).sum(-1) / seen.sum(-1).clamp_min(1)"),
    (R, "- (logits * seen).sum(-1) / seen.sum(-1))", "- (logits * seen).sum(-1) / (~seen).sum(-1))"),
    (R, "p * (p.clamp_min(1e-30).log() - logq)", "q * (p.clamp_min(1e-30).log() - logq)"),
    (R, "att.clamp_min(1e-300).log()", "att.clamp_min(1e-3).log()"),
    (R, "[float(x) / N for x in m]", "[float(x) / (N - 1) for x in m]"),
    (R, "math.log(s + (1 if cfg.bos else 0))", "math.log(s + 1)"),
    # the printed table and summary
    (R, '"tvd_train": mean(tvd[:train_len])', '"tvd_train": mean(tvd[:train_len - 1])'),
    (R, "mean(tvd[train_len:]) if", "mean(tvd[train_len - 1:]) if"),
    (R, "{metrics['kl'][i]:7.4f}", "{metrics['invalid_mass'][i]:7.4f}"),
    (R, "(f\" {raw['tvd'][i]:8.4f}\" if raw", "(f\" {metrics['tvd'][i]:8.4f}\" if raw"),
    (R, "metrics = evaluate(averaged_copy(model, averages[0]), task=task) if averages else raw",
        "metrics = evaluate(model, task=task) if averages else raw"),
    (R, "{r['tvd_train']:.4f} | {r['tvd_extrap']:.4f})", "{r['tvd_extrap']:.4f} | {r['tvd_train']:.4f})"),
    (R, "every = max(1, cfg.steps // 8)", "every = max(1, cfg.steps // 10)"),
    # theory
    (R, 'lambda s, v: v / math.sqrt(s * (v - s))', 'lambda s, v: v / math.sqrt(s * (v - s + 1))'),
    (R, "[2 * n:3 * n][:v, v:] = eye - 1.0 / v", "[2 * n:3 * n][:v, v:] = eye"),
    # plots/lab.py
    (LAB, "return (self.rho + self.gamma * t) ** -self.kappa", "return (self.rho + self.gamma * (t - 1)) ** -self.kappa"),
    (LAB, "alpha * (p - p0)", "alpha * (p0 - p)"),
    (LAB, "p[:, 2 * k] = torch.where(empty, 0.5, 0.0)", "p[:, 2 * k] = torch.where(empty, 0.25, 0.0)"),
    (LAB, "full = depth == 0, depth == self.cfg.max_depth", "full = depth == 0, depth == self.cfg.max_depth - 1"),
    (LAB, "state[\"count\"] > 0,", "state[\"count\"] >= 0,"),
    (LAB, "n.log()[:, None]", "(n + 1).log()[:, None]"),
    (LAB, "COMPARE_SEEDS, COMPARE_EMA = 3, 0.999", "COMPARE_SEEDS, COMPARE_EMA = 3, 0.99"),
    (LAB, "/ max(len(values) - 1, 1))", "/ max(len(values), 1))"),
    (LAB, "5: 2.776,", "5: 2.571,"),
    (LAB, "range(min(k, n - k) + 1)", "range(min(k, n - k))"),
    (LAB, "abs(t - mid) >= abs(w - mid)", "abs(t - mid) > abs(w - mid)"),
    (LAB, "meds[int(0.025 * reps)]", "meds[int(0.05 * reps)]"),
    (LAB, "done.sort(key=lambda d: runs.index(d[0]))", "done.sort(key=lambda d: d[0].seed)"),
    (LAB, 'text = text[:text.rfind("\\n") + 1]', 'text = text[:text.rfind("\\n")]'),
    (LAB, "g.uniform(math.log10(3e-4), -2)", "g.uniform(math.log10(1e-4), -2)"),
    (LAB, "[base.seed + i for i in range(COMPARE_SEEDS)]", "[base.seed + i + 1 for i in range(COMPARE_SEEDS)]"),
    (LAB, "return self.sample(n, 4 * self.cfg.train_len,", "return self.sample(n, 2 * self.cfg.train_len,"),
    (LAB, "last + 1 if last < len(a) else None", "last if last < len(a) else None"),
]


def main(which):
    root = Path(__file__).resolve().parent.parent
    missed, chosen = [], [i for i in range(1, len(MUTANTS) + 1) if not which or i in which]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        for f in subprocess.run(["git", "ls-files"], cwd=root, capture_output=True,
                                text=True).stdout.split():   # the tracked files, as they are now
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, work / f)
        for i in chosen:
            name, old, new = MUTANTS[i - 1]
            path, text = work / name, (root / name).read_text("utf-8")
            assert text.count(old) == 1, f"mutant {i}: {old!r} occurs {text.count(old)} times"
            path.write_text(text.replace(old, new), "utf-8")
            rc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"],
                                cwd=work, capture_output=True).returncode
            path.write_text(text, "utf-8")
            print(f"{i:3d} {'caught' if rc else 'MISSED'}  {name}: {old.strip()[:60]!r}", flush=True)
            missed += [] if rc else [i]
    print(f"{len(chosen) - len(missed)} of {len(chosen)} caught; missed: {missed}")


if __name__ == "__main__":
    main({int(a) for a in sys.argv[1:]})
