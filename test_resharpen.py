"""Tests for resharpen.py: each checks one claim against something computed independently
(a loop over tokens, a closed form, a formula written out by hand). CPU only, seconds."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import resharpen as R


def tiny(**kw):
    cfg = dict(vocab=7, train_len=4, n_embd=8, n_head=2, steps=1, batch_size=4)
    cfg.update(kw)
    return R.Config(**cfg)


def randomize(model, seed=0):
    """Weights of size 1, LayerNorm gains and biases away from (1, 0), so no term hides."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 2 else 0.3)
                    + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()

# ----------------------------------------------------------------------------- task


def test_batches_are_prefixes_of_permutations_and_next_token_is_unseen():
    cfg = tiny(batch_size=200)
    seq = R.SetComplement(cfg).sample(200, cfg.train_len + 1, torch.Generator().manual_seed(0))
    x, y = seq[:, :-1], seq[:, 1:]      # as train() cuts them
    assert x.shape == y.shape == (200, cfg.train_len)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        seq = row_x + row_y[-1:]
        assert len(set(seq)) == len(seq) and all(0 <= t < cfg.vocab for t in seq)
        assert row_y[:-1] == row_x[1:]                 # y is x shifted by one
        for t, nxt in enumerate(row_y):
            assert nxt not in row_x[: t + 1]


def test_next_token_is_uniform_over_unseen_tokens():
    # The first next token after prefix (a,) should be each of the v-1 others equally often.
    v, n = 5, 40000
    perm = R.SetComplement(R.Config(vocab=v)).sample(n, v, torch.Generator().manual_seed(1))
    pairs = torch.bincount(perm[:, 0] * v + perm[:, 1], minlength=v * v).view(v, v).float()
    expected = n / (v * (v - 1))
    off_diag = pairs[~torch.eye(v, dtype=torch.bool)]
    assert pairs.diag().sum() == 0
    assert (off_diag - expected).abs().max() < 5 * math.sqrt(expected)


def test_exact_target_matches_a_loop_over_tokens():
    v = 6
    task = R.SetComplement(R.Config(vocab=v))
    idx = task.sample(10, v - 1, torch.Generator().manual_seed(2))
    p = task.target(idx)
    for b in range(idx.shape[0]):
        for t in range(v - 1):
            seen = set(idx[b, : t + 1].tolist())
            want = [0.0 if i in seen else 1.0 / (v - len(seen)) for i in range(v)]
            assert torch.allclose(p[b, t], torch.tensor(want), atol=1e-7)
    assert torch.allclose(p.sum(-1), torch.ones(10, v - 1))

# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("norm", list(R.NORMS))
def test_changing_a_later_token_leaves_earlier_logits_unchanged(norm, bos):
    model = randomize(R.Transformer(tiny(norm=norm, mlp=True, n_layer=2, bos=bos)))
    a = torch.tensor([[0, 1, 2, 3, 4, 5]])
    b = torch.tensor([[0, 1, 2, 3, 6, 5]])
    la, lb = model(a), model(b)
    assert torch.allclose(la[:, :4], lb[:, :4], atol=1e-6)
    assert not torch.allclose(la[:, 4], lb[:, 4], atol=1e-3)


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("norm", list(R.NORMS))
def test_prefix_order_does_not_change_last_logits(norm, bos):
    # No positional encoding: in one layer the last position sees its prefix as a set.
    # (From two layers on, earlier positions carry their own prefixes, and order leaks in.)
    model = randomize(R.Transformer(tiny(norm=norm, mlp=True, bos=bos)))
    a = torch.tensor([[0, 1, 2, 3, 4]])
    b = torch.tensor([[2, 0, 3, 1, 4]])
    assert torch.allclose(model(a)[0, -1], model(b)[0, -1], atol=1e-5)


def test_bos_is_a_token_at_position_0_whose_output_is_cut():
    model = randomize(R.Transformer(tiny(bos=True, n_layer=2)))
    idx = torch.tensor([[3, 1, 4]])
    logits, atts = model(idx, return_attn=True)
    assert logits.shape == (1, 3, 7) and atts[0].shape == (1, 2, 3, 4)
    # The same weights without --bos, with token 0 given BOS's embedding, fed (0, 3, 1, 4):
    plain = R.Transformer(tiny(n_layer=2)).eval()
    state = model.state_dict()
    state["wte.weight"] = torch.cat([state["wte.weight"][7:], state["wte.weight"][1:7]])
    plain.load_state_dict(state)
    assert torch.allclose(plain(torch.tensor([[0, 3, 1, 4]]))[:, 1:], logits, atol=1e-6)


def layer_norm_by_hand(x, ln):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def attention_by_hand(x, attn):
    """One position at a time, one head at a time, with an explicit softmax."""
    T, C = x.shape
    nh = attn.n_head
    hs = C // nh
    Wq, Wk, Wv = attn.c_attn.weight.split(C, dim=0)  # each (C, C): out x in
    out = torch.zeros(T, C)
    for t in range(T):
        for h in range(nh):
            sl = slice(h * hs, (h + 1) * hs)
            q = Wq[sl] @ x[t]
            scores = torch.stack([q @ (Wk[sl] @ x[i]) / math.sqrt(hs) for i in range(t + 1)])
            w = torch.exp(scores - scores.max())
            w = w / w.sum()
            out[t, sl] = sum(w[i] * (Wv[sl] @ x[i]) for i in range(t + 1))
    return out @ attn.c_proj.weight.T


@pytest.mark.parametrize("norm", list(R.NORMS))
def test_each_norm_placement_equals_its_formula(norm):
    model = randomize(R.Transformer(tiny(norm=norm, n_head=2)))
    idx = torch.tensor([3, 0, 6, 2, 5])
    block = model.blocks[0]
    x = model.wte.weight[idx]
    attn = lambda h: attention_by_hand(h, block.attn)
    ln = lambda h: layer_norm_by_hand(h, block.ln_1)
    if norm in ("pre", "pre-final"):
        x = x + attn(ln(x))            # x + Attn(LN(x))
    elif norm == "post":
        x = x + ln(attn(x))            # x + LN(Attn(x))
    else:
        x = ln(x + attn(x))            # LN(x + Attn(x))
    if norm == "pre-final":
        x = layer_norm_by_hand(x, model.ln_f)
    want = x @ model.lm_head.weight.T
    assert torch.allclose(model(idx[None])[0], want, atol=1e-5)

# ----------------------------------------------------------------------------- EMA


def test_ema_equals_its_closed_form_weighted_average():
    # avg_t = sum_k (1-d) d^(t-k) theta_k / (1 - d^t): the initialization has no weight.
    d = 0.9
    model = torch.nn.Linear(3, 2)
    ema = R.EMA(model, d)
    thetas = [torch.randn(2, 3, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    for th in thetas:
        with torch.no_grad():
            model.weight.copy_(th)
        ema.update(model)
    t = len(thetas)
    want = sum((1 - d) * d ** (t - k) * thetas[k - 1] for k in range(1, t + 1)) / (1 - d**t)
    assert torch.allclose(ema.shadow[0], want, atol=1e-6)
    ema.update(model)  # beta_1 = 1: the first update forgets the initialization entirely
    fresh = R.EMA(model, d)
    fresh.update(model)
    assert torch.allclose(fresh.shadow[0], thetas[-1])

# ----------------------------------------------------------------------------- evaluation


class Oracle(torch.nn.Module):
    """Outputs log p* (seen tokens at -1e9) and attends uniformly."""

    def __init__(self, vocab):
        super().__init__()
        self.cfg = R.Config(vocab=vocab)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx, return_attn=False):
        logits = R.SetComplement(self.cfg).target(idx).clamp_min(1e-30).log().clamp_min(-1e9)
        T = idx.shape[1]
        att = torch.ones(T, T).tril()
        att = (att / att.sum(-1, keepdim=True)).expand(idx.shape[0], 1, T, T)
        return (logits, [att]) if return_attn else logits


def test_oracle_gets_zero_tvd_and_zero_invalid_mass():
    m = R.evaluate(Oracle(9), n_perm=50)
    assert max(m["tvd"]) < 1e-6 and max(m["invalid_mass"]) < 1e-6 and max(m["kl"]) < 1e-6
    # Uniform attention over s tokens has entropy log s.
    assert all(abs(h - math.log(s)) < 1e-5 for s, h in zip(m["length"], m["attn_entropy"]))


def test_uniform_prediction_metrics_match_closed_forms():
    # Zero logits predict 1/v everywhere: TVD = invalid = s/v, KL = log(v/(v-s)), gap = 0.
    v = 10
    model = R.Transformer(R.Config(vocab=v, n_embd=8))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    m = R.evaluate(model, n_perm=20)
    for i, s in enumerate(m["length"]):
        assert m["tvd"][i] == pytest.approx(s / v, abs=1e-6)
        assert m["invalid_mass"][i] == pytest.approx(s / v, abs=1e-6)
        assert m["kl"][i] == pytest.approx(math.log(v / (v - s)), abs=1e-5)
        assert m["logit_gap"][i] == pytest.approx(0, abs=1e-6)

# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("targets", ["sampled", "exact"])
def test_a_few_hundred_steps_lower_the_loss(targets):
    cfg = R.Config(vocab=10, train_len=5, n_embd=16, steps=300, batch_size=64,
                   targets=targets, norm="post", device="cpu")
    _, _, losses = R.train(cfg, log=lambda *a: None)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < first - 0.1 and last > R.SetComplement(cfg).loss_floor() - 0.05


def test_same_seed_gives_same_numbers():
    cfg = R.Config(vocab=8, train_len=4, n_embd=8, steps=20, batch_size=8, device="cpu")
    assert R.train(cfg, log=lambda *a: None)[2] == R.train(cfg, log=lambda *a: None)[2]


def test_save_and_load_give_identical_logits(tmp_path):
    cfg = R.Config(vocab=8, train_len=4, n_embd=8, steps=30, batch_size=8, ema=0.9, device="cpu")
    model, (ema,), _ = R.train(cfg, log=lambda *a: None)
    path = str(tmp_path / "ckpt.pt")
    R.save_checkpoint(path, model, ema, cfg)
    idx = R.SetComplement(cfg).sample(3, 7)
    raw = R.load_checkpoint(path, raw=True)
    assert not raw.training
    R.evaluate(raw, n_perm=5)
    assert not raw.training          # evaluate() restores the mode it found
    assert torch.equal(raw(idx), model.eval()(idx))
    assert torch.equal(R.load_checkpoint(path)(idx), R.averaged_copy(model, ema)(idx))
    assert os.listdir(tmp_path) == ["ckpt.pt"]   # no temporary file left behind

# ----------------------------------------------------------------------------- command line


def test_main_writes_metrics_figures_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "out"
    R.main(["--vocab", "8", "--train-len", "3", "--steps", "10", "--batch-size", "8",
            "--n-embd", "8", "--post-norm", "--ema", "0.9", "--out", str(out),
            "--save", str(tmp_path / "m.pt"), "--device", "cpu"])
    files = sorted(os.listdir(out))
    assert files == ["length.png", "loss.png", "metrics.json"]
    import json
    m = json.loads((out / "metrics.json").read_text())
    assert m["length"] == list(range(1, 8)) and m["config"]["norm"] == "post"
    for key in ("tvd", "invalid_mass", "kl", "attn_entropy", "logit_gap"):
        assert len(m[key]) == 7 and len(m["raw"][key]) == 7
    assert (tmp_path / "m.pt").exists()
    assert "mean TVD" in capsys.readouterr().out


def expect_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


@pytest.mark.parametrize("argv,flag", [
    (["--vocab", "2"], "--vocab"),
    (["--vocab", "ten"], "--vocab"),
    (["--train-len", "0"], "--train-len"),
    (["--vocab", "8", "--train-len", "8"], "--train-len"),
    (["--ema", "1"], "--ema"),
    (["--ema", "-0.1"], "--ema"),
    (["--steps", "0"], "--steps"),
    (["--batch-size", "-3"], "--batch-size"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--n-embd", "10", "--n-head", "3"], "--n-embd"),
    (["--norm", "middle"], "--norm"),
    (["--targets", "soft"], "--targets"),
    (["--task", "dyck", "--compare"], "--task"),
    (["--compare", "--suite"], "--suite"),
    (["--task", "shuffle", "--brackets", "0"], "--brackets"),
])
def test_bad_input_exits_2_with_one_line(argv, flag, capsys, tmp_path):
    expect_exit_2(argv + ["--out", str(tmp_path)], flag, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_where_there_is_none_exits_2(capsys, tmp_path):
    expect_exit_2(["--device", "cuda", "--out", str(tmp_path)], "--device", capsys)


def test_unwritable_paths_exit_2(capsys, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    expect_exit_2(["--out", str(a_file / "sub")], "--out", capsys)
    expect_exit_2(["--out", str(tmp_path), "--save", str(tmp_path / "no" / "m.pt")], "--save",
                  capsys)


def test_nan_loss_stops_and_writes_nothing(capsys, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        R.main(["--lr", "1e30", "--steps", "50", "--out", str(out),
                "--save", str(tmp_path / "m.pt"), "--device", "cpu"])
    assert e.value.code == 1
    assert "at step" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "m.pt").exists()


def test_ema_off_is_exactly_the_raw_weights_of_an_ema_run():
    # The average never feeds back into training, so 'EMA off' needs no separate run.
    cfg = R.Config(vocab=8, train_len=4, n_embd=8, steps=20, batch_size=8, device="cpu")
    plain, _, _ = R.train(cfg, log=lambda *a: None)
    with_ema, (ema,), _ = R.train(R.replace(cfg, ema=0.9), log=lambda *a: None)
    for p, q in zip(plain.parameters(), with_ema.parameters()):
        assert torch.equal(p, q)


def test_bema_equals_its_closed_form():
    # ema_0 = theta_0, ema_t = (1 - b_t) ema_(t-1) + b_t theta_t,
    # bema_t = a_t (theta_t - theta_0) + ema_t
    model = torch.nn.Linear(2, 2, bias=False)
    theta0 = model.weight.detach().clone()
    bema = R.BEMA(model)
    thetas = [torch.randn(2, 2, generator=torch.Generator().manual_seed(k)) for k in range(5)]
    ema = theta0
    for t, th in enumerate(thetas, start=1):
        with torch.no_grad():
            model.weight.copy_(th)
        bema.update(model)
        b, a = (10 + t) ** -0.5, (10 + t) ** -0.2
        ema = (1 - b) * ema + b * th
    assert torch.allclose(bema.averaged()[0], a * (thetas[-1] - theta0) + ema, atol=1e-6)


def test_bema_without_correction_is_the_ema_with_the_same_schedule():
    model = torch.nn.Linear(3, 3)
    bema, plain = R.BEMA(model, correct=False), R.EMA(model, decay=0.5)
    plain.beta = bema.beta          # same schedule, plain update rule
    for k in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
        bema.update(model)
        plain.update(model)
    for a, b in zip(bema.averaged(), plain.averaged()):
        assert torch.allclose(a, b)


def test_cosine_schedule_starts_at_lr_and_ends_at_zero():
    cfg = R.Config(lr=0.01, steps=101, lr_schedule="cosine")
    assert R.learning_rate(cfg, 1) == pytest.approx(0.01)
    assert R.learning_rate(cfg, 51) == pytest.approx(0.005)
    assert R.learning_rate(cfg, 101) == pytest.approx(0.0, abs=1e-12)
    assert R.learning_rate(R.replace(cfg, lr_schedule="constant"), 101) == 0.01

# ----------------------------------------------------------------------------- theory


@pytest.mark.parametrize("vocab", [5, 12, 32])
@pytest.mark.parametrize("norm", R.HAND_BUILT_NORMS)
def test_hand_built_models_match_the_formulas(vocab, norm):
    gamma = 1.7
    model = R.hand_built(vocab, norm, gamma)
    task = R.SetComplement(R.Config(vocab=vocab))
    perm = task.sample(8, vocab - 1, torch.Generator().manual_seed(3))
    logits = model(perm)
    seen = task.target(perm) == 0
    for s in range(1, vocab):
        row, mask = logits[:, s - 1], seen[:, s - 1]
        lo, hi = row[mask].view(8, s), row[~mask].view(8, vocab - s)
        # Balanced: every seen logit equal, every unseen logit equal (theory.md, section 3).
        assert (lo - lo[:, :1]).abs().max() < 1e-9 and (hi - hi[:, :1]).abs().max() < 1e-9
        margin = (hi[:, 0] - lo[:, 0]).mean().item()
        assert margin == pytest.approx(R.predicted_margin(vocab, norm, s, gamma), abs=1e-9)
    m = R.evaluate(model, n_perm=20)
    for s, tvd, inv, gap in zip(m["length"], m["tvd"], m["invalid_mass"], m["logit_gap"]):
        want = R.predicted_tvd(vocab, s, R.predicted_margin(vocab, norm, s, gamma))
        assert tvd == pytest.approx(want, rel=1e-6, abs=1e-14)
        assert inv == pytest.approx(tvd, rel=1e-6, abs=1e-14)   # TVD = invalid mass


def test_pre_norm_margin_decays_like_two_over_s():
    # theory.md, section 3: margin(s) = (2 / s) margin(2) under uniform attention.
    m2 = R.predicted_margin(20, "pre", 2)
    model = R.evaluate(R.hand_built(20, "pre"), n_perm=10)
    for s, gap in zip(model["length"], model["logit_gap"]):
        assert gap == pytest.approx(2 / s * m2, rel=1e-5)


def test_post_norm_margin_is_v_over_sqrt_s_v_minus_s_and_at_least_2():
    # theory.md, section 5, with eps = 0: margin = gamma sqrt(n / v) v / sqrt(s (v - s)), n = 2v.
    v = 16
    for s in range(1, v):
        m = R.predicted_margin(v, "post", s, eps=0.0)
        assert m == pytest.approx(math.sqrt(2) * v / math.sqrt(s * (v - s)), rel=1e-12)
        assert m >= 2 * math.sqrt(2) - 1e-12   # equality at s = v / 2


def test_value_dimension_below_v_minus_1_cannot_fit_lengths_1_and_2():
    # theory.md, section 2: balanced logits at lengths 1 and 2 need head_dim >= v - 1; the
    # construction with n_embd = 2v - 2, head_dim = v - 1 fits them exactly.
    v = 5
    assert R.fit_lengths_1_2(v, 2 * v - 2, v - 1) < 1e-4
    below = min(R.fit_lengths_1_2(v, 2 * v, v - 2, seed=k) for k in range(2))
    assert below > 0.1


@pytest.mark.parametrize("norm_cls", ["layer", "rms"])
def test_norm_on_uncentred_one_hot_values(norm_cls):
    # theory.md, section 5: with values e_x (not centred), LayerNorm gives n / sqrt(s (n - s)),
    # bounded below by 2, while RMSNorm, which does not subtract the mean, gives sqrt(n / s).
    v, n = 12, 24
    model = R.hand_built(v, "post")
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.c_attn.weight[2 * n:3 * n][:v, v:] = torch.eye(v, dtype=torch.double)
    if norm_cls == "rms":
        model.blocks[0].ln_1 = torch.nn.RMSNorm(n, eps=0.0).double()
    else:
        model.blocks[0].ln_1.eps = 0.0
    m = R.evaluate(model, n_perm=5)
    for s, gap in zip(m["length"], m["logit_gap"]):
        want = n / math.sqrt(s * (n - s)) if norm_cls == "layer" else math.sqrt(n / s)
        assert gap == pytest.approx(want, rel=1e-9)


def test_sampled_gradient_covariance_is_diag_p_minus_p_p():
    # theory.md, section 6: the gradient of -log q_y w.r.t. the logits is q - e_y; with y ~ p*
    # its mean is q - p* and its covariance diag(p*) - p* p*^T, of trace 1 - 1/k.
    v, k, n = 6, 4, 200000
    p = torch.zeros(v, dtype=torch.double)
    p[:k] = 1 / k
    logits = torch.randn(v, dtype=torch.double, requires_grad=True)
    y = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(0))
    q = logits.softmax(-1).detach()
    grads = q - F.one_hot(y, v).double()            # the closed-form gradient, checked below
    loss = F.cross_entropy(logits.expand(3, v), y[:3], reduction="sum")
    loss.backward()
    assert torch.allclose(logits.grad, grads[:3].sum(0))
    cov = torch.cov(grads.T)
    assert torch.allclose(grads.mean(0), q - p, atol=0.01)
    assert torch.allclose(cov, torch.diag(p) - torch.outer(p, p), atol=0.01)
    assert cov.trace().item() == pytest.approx(1 - 1 / k, abs=0.01)


def test_ema_variance_on_a_noisy_quadratic_matches_closed_form():
    # theory.md, section 6: SGD on h theta^2 / 2 with gradient noise sigma has stationary
    # variance V = eta sigma^2 / (h (2 - eta h)); an EMA of decay d has
    # V (1 - d) / (1 + d) * (1 + d rho) / (1 - d rho), rho = 1 - eta h.
    eta, h, sigma, d, chains, steps = 0.1, 1.0, 1.0, 0.95, 4000, 1500
    g = torch.Generator().manual_seed(0)
    box = torch.nn.Linear(chains, 1, bias=False)   # its weight: one theta per chain
    with torch.no_grad():
        box.weight.zero_()
    ema = R.EMA(box, d)
    for _ in range(steps):
        with torch.no_grad():
            box.weight -= eta * (h * box.weight + sigma * torch.randn(1, chains, generator=g))
        ema.update(box)
    V = eta * sigma**2 / (h * (2 - eta * h))
    rho = 1 - eta * h
    V_ema = V * (1 - d) / (1 + d) * (1 + d * rho) / (1 - d * rho)
    assert box.weight.var().item() == pytest.approx(V, rel=0.08)
    assert ema.shadow[0].var().item() == pytest.approx(V_ema, rel=0.08)


def readme_exercise_commands():
    """Every `python resharpen.py ...` line in the README's Exercises section."""
    import pathlib
    import shlex
    text = (pathlib.Path(__file__).parent / "README.md").read_text()
    section = text.split("## Exercises", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line)[2:] for line in section.splitlines()
            if line.startswith("python resharpen.py")]


def test_readme_has_the_exercise_commands():
    assert len(readme_exercise_commands()) >= 15


@pytest.mark.parametrize("argv", readme_exercise_commands(), ids=" ".join)
def test_exercise_commands_still_run(argv, tmp_path, capsys):
    # Each exercise's command, for 3 steps, writing into a temporary folder.
    argv = list(argv)
    for flag in ("--out", "--save"):
        if flag in argv:
            i = argv.index(flag)
            argv[i + 1] = str(tmp_path / os.path.basename(argv[i + 1]))
    R.main(argv + ["--steps", "3", "--device", "cpu"] + ([] if "--out" in argv else
                                                         ["--out", str(tmp_path)]))
    assert "mean TVD" in capsys.readouterr().out

# ----------------------------------------------------------------------------- languages
# An independent description of each language, in plain Python lists: tokens 0..k-1 open,
# k..2k-1 close, 2k END; a stream of strings, each ended by END.


def legal_prefix(seq, task, k, D):
    """Is seq a prefix of some stream of the language?"""
    stack, counts = [], [0] * k
    for tok in seq:
        if tok == 2 * k:                                  # END: only with nothing open
            if stack or any(counts):
                return False
        elif tok < k:                                     # open
            if task == "dyck":
                if len(stack) == D:
                    return False
                stack.append(tok)
            counts[tok] += 1
        else:                                             # close
            if task == "dyck" and (not stack or stack[-1] != tok - k):
                return False
            if task == "shuffle" and counts[tok - k] == 0:
                return False
            if task == "dyck":
                stack.pop()
            counts[tok - k] -= 1
    return True


def dyck_probability(seq, k, D):
    """The automaton's probability of the token sequence, rule by rule (Hewitt et al. 2020:
    empty stack: each open 1/(2k), END 1/2; full: the matching close; else each open
    1/(2k), the matching close 1/2)."""
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


LANGUAGES = [dict(task="dyck", brackets=2, max_depth=2), dict(task="dyck", brackets=1, max_depth=3),
             dict(task="shuffle", brackets=2), dict(task="shuffle", brackets=1)]


@pytest.mark.parametrize("lang", LANGUAGES, ids=str)
def test_language_samplers_emit_only_legal_streams(lang):
    cfg = R.language_config(**lang)
    seqs = R.Language(cfg).sample(300, 40, torch.Generator().manual_seed(0))
    for seq in seqs.tolist():
        assert legal_prefix(seq, cfg.task, cfg.brackets, cfg.max_depth)


@pytest.mark.parametrize("lang", LANGUAGES, ids=str)
def test_language_targets_sum_to_1_and_vanish_exactly_on_illegal_tokens(lang):
    cfg = R.language_config(**lang)
    seqs = R.Language(cfg).sample(40, 25, torch.Generator().manual_seed(1))
    p = R.Language(cfg).target(seqs, torch.double)
    assert torch.allclose(p.sum(-1), torch.ones(40, 25, dtype=torch.double))
    for b, seq in enumerate(seqs.tolist()):
        for t in range(25):
            for a in range(cfg.vocab):
                legal = legal_prefix(seq[: t + 1] + [a], cfg.task, cfg.brackets, cfg.max_depth)
                assert (p[b, t, a] > 0) == legal


@pytest.mark.parametrize("lang", LANGUAGES, ids=str)
def test_language_targets_equal_brute_force_over_all_short_streams(lang):
    # Enumerate every token sequence of length n; keep the legal ones, weighted by the
    # automaton (Dyck) or counted (Shuffle: uniform over legal next tokens, so a stream's
    # weight is the product of 1 / (number of legal next tokens)).
    import itertools
    cfg = R.language_config(**lang)
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
    streams = {s: weight(s) for s in itertools.product(range(v), repeat=n)}
    streams = {s: w for s, w in streams.items() if w > 0}
    assert all(legal_prefix(list(s), cfg.task, k, D) for s in streams)
    prefix_mass = {}
    for s, w in streams.items():
        for t in range(1, n + 1):
            prefix_mass[s[:t]] = prefix_mass.get(s[:t], 0.0) + w
    idx = torch.tensor(list(streams))
    p = R.Language(cfg).target(idx[:, : n - 1], torch.double)
    for b, s in enumerate(streams):
        for t in range(1, n):
            brute = [prefix_mass.get(s[:t] + (a,), 0.0) / prefix_mass[s[:t]] for a in range(v)]
            assert torch.allclose(p[b, t - 1], torch.tensor(brute, dtype=torch.double), atol=1e-12)


def test_suite_and_comparison_run_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)   # in this process, one run at a time
    base = R.Config(vocab=6, train_len=3, n_embd=8, steps=3, batch_size=4, device="cpu")
    R.compare(base, str(tmp_path))
    R.suite(base, str(tmp_path), steps=3, batch_size=4, n_embd=8, train_len=4)
    assert {"compare.md", "compare.json", "compare_norms.png", "compare_dispersion.png",
            "compare_noise.png", "suite.md", "suite.json", "suite.png"} <= set(os.listdir(tmp_path))
    text = (tmp_path / "suite.md").read_text()
    assert "Dyck-(2, 4)" in text and "Shuffle-2" in text
    assert text.isascii() and (tmp_path / "compare.md").read_text().isascii()
    assert capsys.readouterr().out.isascii()


def test_a_norm_on_a_bos_average_recovers_the_depth_at_any_length():
    # theory.md, section 8: uniform attention over BOS (value e_0) and t brackets (values
    # +e_1 for an open, -e_1 for a close) averages to (e_0 + depth e_1) / (t + 1). Its size
    # shrinks with t, but LayerNorm (eps = 0) returns the same vector for the same depth.
    def attn_average(opens, closes):
        values = [torch.tensor([1.0, 0, 0, 0])] + [torch.tensor([0, 1.0, 0, 0])] * opens \
            + [torch.tensor([0, -1.0, 0, 0])] * closes
        return torch.stack(values).mean(0).double()
    ln = lambda h: F.layer_norm(h, (4,), eps=0.0)
    for depth in range(4):
        short, long = attn_average(depth, 0), attn_average(depth + 20, 20)
        assert not torch.allclose(short, long)
        assert torch.allclose(ln(short), ln(long), atol=1e-12)
    assert not torch.allclose(ln(attn_average(1, 0)), ln(attn_average(2, 0)))

# ----------------------------------------------------------------------------- reliability
# Every input check_args accepts runs to the end; what fails after training fails with one
# line and leaves the folder either untouched or complete.

SMALL = ["--steps", "2", "--batch-size", "4", "--n-embd", "8", "--device", "cpu"]


def test_training_on_every_length_runs_to_the_end(tmp_path, capsys):
    # train_len = v - 1 leaves no length to extrapolate to: the summary says so.
    import json
    R.main(["--vocab", "3", "--train-len", "2", "--out", str(tmp_path)] + SMALL)
    assert "extrapolation none" in capsys.readouterr().out
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["summary"]["tvd_extrap"] is None and len(m["tvd"]) == 2


@pytest.mark.parametrize("argv,flag", [
    (["--compare", "--vocab", "8", "--train-len", "7"], "--train-len"),
    (["--save", "SAVE/sub/"], "--save"),
    (["--save", ""], "--save"),
    (["--save", "OUT/metrics.json"], "--save"),
    (["--save", "SAVE/m.pt", "--theory"], "--save"),
    (["--save", "SAVE/m.pt", "--compare"], "--save"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--vocab", "2000"], "--vocab"),
    (["--n-layer", "100000"], "--n-layer"),
    (["--n-embd", "100000"], "--n-embd"),
    (["--batch-size", "10000000"], "--batch-size"),
    (["--vocab", "1024", "--train-len", "1023"], "--batch-size"),   # 8 GiB per step
    (["--task", "dyck", "--brackets", "100000"], "--brackets"),
    (["--task", "dyck", "--train-len", "1000"], "--train-len"),
    (["--task", "dyck", "--vocab", "9"], "--vocab"),
    (["--brackets", "3"], "--brackets"),
    (["--task", "shuffle", "--max-depth", "3"], "--max-depth"),
    (["--theory", "--steps", "5"], "--steps"),
    (["--compare", "--post-norm"], "--norm"),
    (["--suite", "--vocab", "9"], "--vocab"),
    (["--ste", "5"], "--ste"),                   # no abbreviations: one spelling per flag
])
def test_inputs_that_cannot_run_to_the_end_exit_2_before_training(argv, flag, capsys, tmp_path):
    out = tmp_path / "new"
    argv = [a.replace("SAVE", str(tmp_path)).replace("OUT", str(out)) for a in argv]
    expect_exit_2(argv + ["--out", str(out)], flag, capsys)
    assert not out.exists()                      # a rejected run creates nothing


def test_suite_honours_the_model_flags_it_is_given(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(R, "suite", lambda cfg, out, **kw: seen.update(kw))
    R.main(["--suite", "--steps", "5", "--lr", "0.01", "--out", str(tmp_path)])
    assert seen == {"steps": 5, "lr": 0.01}
    cfgs = R.suite_grid(R.Config(), **seen)
    assert {(c.steps, c.lr, c.vocab) for c in cfgs} == {(5, 0.01, 5)}


def test_a_huge_learning_rate_stops_with_exit_1_and_writes_nothing(capsys, tmp_path):
    # One step: the loss before it is finite, the weights after it are not.
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        R.main(["--lr", "1e30", "--steps", "1", "--out", str(out),
                "--save", str(tmp_path / "m.pt")] + SMALL[2:])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Nothing was written" in err
    assert not out.exists() and not (tmp_path / "m.pt").exists()


def test_files_are_strict_json_with_their_hashes_and_the_usual_mode(tmp_path):
    import hashlib
    import json
    out = tmp_path / "out"
    R.main(["--ema", "0.9", "--out", str(out), "--save", str(tmp_path / "m.pt")] + SMALL)
    bad = lambda x: pytest.fail(f"non-strict JSON constant {x}")
    m = json.loads((out / "metrics.json").read_text(), parse_constant=bad)
    for name, digest in m["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert m["checkpoint"]["sha256"] == hashlib.sha256((tmp_path / "m.pt").read_bytes()).hexdigest()
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp_path / "m.pt", *out.iterdir()]:
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask, path
    assert sorted(os.listdir(out)) == ["length.png", "loss.png", "metrics.json"]


def test_a_failed_write_names_what_was_written_and_leaves_no_record(monkeypatch, capsys,
                                                                    tmp_path):
    real = R.write_bytes

    def full_disk(path, data):
        if path.endswith("loss.png"):
            raise OSError(28, "No space left on device")
        real(path, data)
    monkeypatch.setattr(R, "write_bytes", full_disk)
    with pytest.raises(SystemExit) as e:
        R.main(["--out", str(tmp_path)] + SMALL)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1
    assert "No space left" in err and "written: length.png" in err
    assert sorted(os.listdir(tmp_path)) == ["length.png"]   # no metrics.json, no temp file


def test_ctrl_c_during_training_exits_130_with_one_line(monkeypatch, capsys, tmp_path):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(R, "train", interrupted)
    with pytest.raises(SystemExit) as e:
        R.main(["--out", str(tmp_path / "out")] + SMALL)
    assert e.value.code == 130
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _writer(out, tag, rounds):
    """One of two processes writing the same folder: every round, distinct contents."""
    for i in range(rounds):
        files = {name: f"{tag} {i} {name}".encode() * 2000 for name in ("a.png", "b.png")}
        R.write_outputs(out, files, "record.json", {"tag": tag, "round": i})


def test_two_processes_writing_one_folder_leave_whole_files_from_one_run(tmp_path):
    import hashlib
    import json
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 60)) for tag in "AB"]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    record = json.loads((tmp_path / "record.json").read_text())
    for name, digest in record["files"].items():   # every file is the record's run's
        data = (tmp_path / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
        assert data.startswith(f"{record['tag']} {record['round']} ".encode())
    assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png", "record.json"]


def test_evaluation_in_chunks_equals_one_pass(monkeypatch):
    model = randomize(R.Transformer(tiny(vocab=9, n_layer=2, bos=True))).double()
    whole = R.evaluate(model, n_perm=30)
    monkeypatch.setattr(R, "EVAL_CHUNK", 1)          # one input at a time
    chunked = R.evaluate(model, n_perm=30)
    for key in whole:
        assert chunked[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-12)


def test_bos_changes_the_uniform_entropy_to_log_s_plus_1():
    m = R.evaluate(R.hand_built(6, "post"), n_perm=3)
    assert m["log_positions"] == pytest.approx([math.log(s) for s in range(1, 6)])
    model = R.Transformer(R.Config(vocab=6, n_embd=8, bos=True))
    m = R.evaluate(model, n_perm=3)
    assert m["log_positions"] == pytest.approx([math.log(s + 1) for s in range(1, 6)])
    assert "log(s+1)" in R.format_table(m, 2)


def test_the_first_progress_line_comes_early():
    lines = []
    R.train(R.Config(vocab=6, train_len=3, n_embd=8, steps=160, batch_size=2, device="cpu"),
            log=lines.append)
    assert lines[0].startswith("step    10/160") and len(lines) == 9   # at 10, then every 20


def test_loading_a_broken_checkpoint_says_what_it_is(tmp_path):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a resharpen.py checkpoint"):
        R.load_checkpoint(str(path))


def test_bad_backend_ascii_console_and_closed_pipe_do_not_crash(tmp_path):
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "resharpen.py")
    env = {**os.environ, "MPLBACKEND": "no_such_backend", "PYTHONIOENCODING": "ascii"}
    run = subprocess.run([sys.executable, script, "--out", str(tmp_path)] + SMALL, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "metrics.json").exists()
    # A reader that closed its end before anything was written: exit 1, no traceback.
    proc = subprocess.Popen([sys.executable, script, "--out", str(tmp_path)] + SMALL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1 and proc.stderr.read() == b""
