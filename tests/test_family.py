"""The DARTS family's parts on the one supernet (`rnn_darts.relax`, `rnn_darts.callbacks.arch`): each part's equation against
a plain version written here, and each method through a real `search_learner` fit; bad combinations get one line. That each method's seeded fit
repeats and resumes bit for bit is tests/test_resume.py's."""
import functools
import pytest, torch, torch.nn.functional as F
from fastai.callback.core import Callback
from rnn_darts.core import UsageError
from rnn_darts.config import SearchConfig, METHODS, RELAXATIONS as RELAX_NAMES, TEMPERED, DRAWN, configured
from rnn_darts.data import numbers_corpus, lm_dls
from rnn_darts.genotypes import edge_slices, derive_genotype
from rnn_darts.learner import search_learner
from rnn_darts.model import DartsRnnSearch
from rnn_darts.relax import RELAXATION_CLASSES, Drnas, Gdas, dirichlet_concentration
from rnn_darts.callbacks.arch import (hypergrad, hypergrad_mixed, hypergrad_single, train_loss, search_loss, penalty_grad,
                                      beta_decay_loss, alpha_penalty, alpha_terms, arch_grad)
from tests._learners import tiny_learner

NHID = 8
FAMILY = 1200   # training tokens: 15 batches an epoch at bs 8 and bptt 10; each test passes the fewest its property needs

def fit(learn, n=1, cbs=()):
    with learn.no_logging(): learn.fit(n, cbs=list(cbs))

def tiny(relax='softmax', seed=0):
    torch.manual_seed(seed)
    return DartsRnnSearch(30, NHID, NHID, dropout=0, dropouth=0, dropoutx=0, dropouti=0, relax=relax).double().train()

def batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 30, (4, 6), generator=g), torch.randint(0, 30, (4, 6), generator=g)) for _ in range(2)]

# ------------------------------------------------------------------ the registries agree
def test_the_config_names_every_relaxation_and_each_method_builds_a_valid_config():
    assert tuple(RELAXATION_CLASSES) == RELAX_NAMES
    assert {n for n, r in RELAXATION_CLASSES.items() if r.tau is not None} == set(TEMPERED)
    assert {n for n, r in RELAXATION_CLASSES.items() if r.stochastic} == set(DRAWN)
    for name, parts in METHODS.items():
        c = configured(SearchConfig, None, 'search_learner', dict(method=name))
        assert all(getattr(c, k) == v for k, v in parts.items()), name

# ------------------------------------------------------------------ equations
def test_dirichlet_pathwise_gradient_is_the_gradient_of_the_expectation():
    "DrNAS's reparameterised sample: the mean over many draws of ∇α Σ c·w equals ∇α of Σ c·E[w], E[w] = conc / Σ conc"
    torch.manual_seed(0)
    a = torch.randn(3, 5, dtype=torch.float64)
    c = torch.randn(3, 5, dtype=torch.float64)
    big = a.expand(40_000, 3, 5).clone().requires_grad_()
    (g,) = torch.autograd.grad((Drnas().sample(big) * c).sum() / 40_000, big)
    a1 = a.clone().requires_grad_()
    (want,) = torch.autograd.grad((Drnas().probs(a1) * c).sum(), a1)
    torch.testing.assert_close(g.sum(0), want, atol=0.02, rtol=0.05)
    assert (g.sum(0) - want).abs().max() < 0.5 * want.abs().max()   # not merely small: the same gradient

def test_dirichlet_sample_is_torch_distributions_draw():
    a = torch.randn(36, 5, dtype=torch.float64)
    torch.manual_seed(3); w = Drnas().sample(a)
    torch.manual_seed(3); d = torch.distributions.Dirichlet(F.elu(a) + 1).rsample()
    assert torch.equal(w, d)

def test_milenas_gradient_is_the_training_gradient_plus_lambda_validation_gradient():
    m, (trn, val) = tiny(), batches()
    m.alpha.requires_grad_(True)
    with torch.random.fork_rng():
        g, loss = hypergrad_mixed(m, trn, val, lam=0.3)
    m.reset()
    gt = torch.autograd.grad(m.loss(*trn, 'train', advance=False, weight_grads=False, update_stats=False), m.alpha)[0]
    lv = m.loss(*val, 'search', weight_grads=False, update_stats=False)
    gv = torch.autograd.grad(lv, m.alpha)[0]
    torch.testing.assert_close(g, gt + 0.3 * gv, rtol=1e-10, atol=1e-12)
    assert float(loss) == float(lv.detach())
    assert not torch.allclose(gt, gv)   # the two levels differ: the sum is not one of them

def test_single_level_gradient_is_the_training_losss():
    m, (trn, val) = tiny(), batches()
    m.alpha.requires_grad_(True)
    g, loss = hypergrad_single(m, trn, val)
    m.reset()
    l = m.loss(*trn, 'train', advance=False, weight_grads=False, update_stats=False)
    torch.testing.assert_close(g, torch.autograd.grad(l, m.alpha)[0], rtol=1e-10, atol=1e-12)
    assert float(loss) == float(l.detach())

def test_beta_decay_gradient_is_the_softmax_over_edges():
    a = torch.randn(36, 5, dtype=torch.float64)
    torch.testing.assert_close(penalty_grad(a, beta_decay_loss), F.softmax(a, -1) / 36)
    kl = lambda x: torch.distributions.kl_divergence(torch.distributions.Dirichlet(F.elu(x) + 1),
                                                     torch.distributions.Dirichlet(torch.ones_like(x))).sum()
    x = a.clone().requires_grad_()
    want = torch.autograd.grad(2.5 * torch.logsumexp(x, -1).mean() + 1e-3 * kl(x), x)[0]
    terms = alpha_terms(beta_decay=250., kl=1e-3)
    for t in terms: t.at_epoch(1)                                   # β-DARTS's λ = 250 × 1 / 100
    torch.testing.assert_close(penalty_grad(a, alpha_penalty(terms)), want)
    assert alpha_terms() == [] and alpha_penalty([]) is None

def test_gumbel_noise_is_shared_by_the_passes_of_one_architecture_step_only():
    "Inside an architecture pass (frozen masks) two training losses see one Gumbel draw, as the unrolled step's finite differences need; outside, each forward draws anew"
    for relax in TEMPERED:
        m, (trn, _) = tiny(relax), batches()
        m.tau.fill_(0.5)
        with m.frozen_masks(): a, b = train_loss(m, *trn), train_loss(m, *trn)
        assert float(a.detach()) == float(b.detach()), relax
        assert float(train_loss(m, *trn).detach()) != float(train_loss(m, *trn).detach()), relax

def test_snas_samples_the_gumbel_softmax_at_tau():
    "SNAS's training weights per edge: softmax((α + g) / τ) of its drawn Gumbel noise g, as written here; a lower τ sharpens them"
    torch.manual_seed(0)
    a, g = torch.randn(36, 5, dtype=torch.double), torch.randn(36, 5, dtype=torch.double)
    plain = lambda tau: torch.exp((a + g) / tau) / torch.exp((a + g) / tau).sum(-1, keepdim=True)
    for tau in (1., 0.1): torch.testing.assert_close(RELAXATION_CLASSES['snas']().sample(a, tau, g), plain(tau))

def test_gdas_forward_runs_one_discrete_cell_per_draw():
    "A GDAS training forward equals the derived model of its one-hot weights: each node one (predecessor, op) pair"
    m = tiny('gdas'); m.tau.fill_(1.)
    w = m.mixing_weights('train').detach()
    for sl in edge_slices(8): assert w[sl].sum() == 1 and (w[sl] > 0).sum() == 1
    assert w[:, 0].sum() == 0
    m.eval()
    e = m.mixing_weights('valid')
    assert torch.equal(e, Gdas(8).evaluate(m.alpha.detach()))

def test_snas_evaluates_its_child_network_not_the_derived_cell():
    "SNAS's evaluation weights are each edge's argmax op, `none` included: a node keeps every edge whose argmax is an op, where the genotype keeps one pair"
    a = torch.zeros(36, 5, dtype=torch.double)
    a[1:3, 2] = 1.                        # node 2's two edges: relu wins on each
    a[0, 0] = 1.                          # node 1's one edge: none wins
    w = RELAXATION_CLASSES['snas']().evaluate(a)
    sl = edge_slices(8)
    assert w[sl[1], 1:].sum() == 2 and w[sl[0], 1:].sum() == 0 and torch.equal(w.sum(-1), torch.ones(36, dtype=torch.double))
    g = derive_genotype(F.softmax(a, -1).numpy(), 8)
    assert len(g.recurrent) == 8 and g.recurrent[1][0] == 'relu' and all(op != 'none' for op, _ in g.recurrent)   # one pair per node

def test_the_stochastic_relaxations_evaluate_deterministically():
    x = torch.randint(0, 30, (4, 6))
    for relax in DRAWN:
        m = tiny(relax).eval()
        with torch.no_grad(): a, b = m(x)[0], (m.reset(), m(x)[0])[1]
        assert torch.equal(a, b), relax

# ------------------------------------------------------------------ through search_learner
class Taus(Callback):
    order = 100
    def __init__(self): self.seen = []
    def before_batch(self):
        if self.training and self.iter == 0:
            m = self.model
            beta = [float(t.weight) for t in self.learn.arch_param_update.terms if t.name == 'beta_decay']
            self.seen.append((float(m.tau) if hasattr(m, 'tau') else None, beta[0] if beta else None))

@pytest.mark.parametrize('method,want', [('gdas', [(10., None), (5.05, None), (0.1, None)]), ('snas', [(1., None), (0.515, None), (0.03, None)]),
                                         ('beta-darts', [(None, 24.), (None, 24.5)])])
def test_schedules_follow_the_papers_over_the_fit(method, want):
    """Three epochs of two or three training batches each (the τ schedule's start, middle and end); β-DARTS's λ in the
    last two of the paper's 50 epochs (a fit of 50 from epoch 48), where its authors' code, 50 × epoch / 100, reaches 24.5"""
    rec = Taus()
    learn = tiny_learner(method=method, n_train=100, n_valid=100)
    if method == 'beta-darts':
        with learn.no_logging(): learn.fit(50, start_epoch=48, cbs=[rec])
    else: fit(learn, 3, [rec])
    for (t, b), (wt, wb) in zip(rec.seen, want):
        assert (t is None) == (wt is None) and (b is None) == (wb is None)
        if t is not None: assert abs(t - wt) < 1e-6
        if b is not None: assert abs(b - wb) < 1e-5
    assert len(rec.seen) == len(want)

def test_the_taus_a_run_uses_are_its_recorded_settings():
    "τ left out is the relaxation's paper value in the config, the command line's settings and their sources (what run.json records), not null; a run.json from before (null) resumes as the same settings"
    from rnn_darts.config import SearchConfig, TAU
    from rnn_darts.options import settings_and_sources, check_settings
    from rnn_darts.runs import settings_diff
    c = SearchConfig(method='gdas')
    assert (c.tau_max, c.tau_min) == TAU['gdas'] == (10., 0.1) and c.sources()['tau_max'] == '--relax gdas'
    assert (SearchConfig(relax='snas', mode='single', tau_min=0.5).tau_max, SearchConfig().tau_max) == (1., None)
    s, src = settings_and_sources('search', method='snas', tau_max=2.)
    assert (s['tau_max'], s['tau_min'], src['tau_max'], src['tau_min']) == (2., 0.03, 'flag', '--relax snas')
    s, src = settings_and_sources('search', relax='gdas', mode='first', tau_max=0.05)
    with pytest.raises(ValueError, match=r"--tau-min \(--relax gdas\) \(0.1\) cannot exceed --tau-max \(0.05\)"): check_settings(s, src)
    old = {**settings_and_sources('search', method='gdas')[0], 'tau_max': None, 'tau_min': None}
    assert settings_diff(old, settings_and_sources('search', method='gdas')[0]) == {}

def test_tau_settings_override_the_papers():
    rec = Taus()
    fit(tiny_learner(method='gdas', tau_max=4., tau_min=2., n_train=100, n_valid=100), 2, [rec])
    assert [round(t, 6) for t, _ in rec.seen] == [4., 2.]

# ------------------------------------------------------------------ bad combinations
@pytest.mark.parametrize('settings,msg', [
    (dict(relax='gdas', mode='exact'), "relax gdas draws its mixing weights: the exact hypergradient (mode exact)"),
    (dict(relax='drnas', mode='second'), "relax drnas with mode second"),
    (dict(tau_max=3.), "tau_max (GDAS's and SNAS's first temperature τ) has an effect only with relax gdas or snas, and relax is softmax"),
    (dict(relax='gdas', tau_max=1., tau_min=2.), "tau_min (2.0) cannot exceed tau_max (1.0)"),
    (dict(dirichlet_kl=1e-3), "dirichlet_kl (DrNAS's Dirichlet KL weight) has an effect only with relax drnas, and relax is softmax"),
    (dict(relax='sigmoid', beta_decay=1.), "beta_decay (β-DARTS's decay of α's logsumexp, a softmax's normaliser) has an effect only with relax softmax, gdas or snas, and relax is sigmoid"),
    (dict(mode='first', zero_one=1.), "zero_one (Fair DARTS's zero-one loss weight) has an effect only with relax sigmoid, and relax is softmax"),
    (dict(mode='first', epsilon=0.1), "epsilon (SDARTS's perturbation radius) has an effect only with perturb random or adversarial, and perturb is none"),
    (dict(relax='gdas', perturb='random'), "perturb (SDARTS) perturbs softmax mixing weights on the simplex; relax gdas is not softmax"),
    (dict(relax='snas', mode='first', select='pt'), "select pt (DARTS-PT) removes ops from softmax mixing weights; relax snas is not softmax"),
    (dict(mixed_lambda=2.), "mixed_lambda (MiLeNAS's weight of the validation gradient) has an effect only with mode mixed, and mode is second"),
    (dict(method='gdas', relax='snas'), "method gdas sets relax to 'gdas'; relax 'snas' contradicts it"),
    (dict(method='random', beta_decay=2.), "beta_decay applies to the architecture weights α, which random search (mode random) does not have"),
])
def test_bad_combinations_are_refused_with_one_line(settings, msg):
    with pytest.raises(ValueError) as e: tiny_learner(**{'n_train': FAMILY, **settings})
    assert msg in str(e.value) and '\n' not in str(e.value)

@pytest.mark.slow
def test_a_method_fixes_its_parts_and_leaves_its_own_settings_to_the_user(tmp_path, capsys):
    """(#67) Who set a setting decides, not whether it equals the default. A method's part given by the user is refused
    when it contradicts the method, even at the default (GDAS is first order; `mode='second'` is the default), in a
    config, a keyword and the command line alike; a method's own hyper-parameter is the user's (DrNAS's KL weight,
    β-DARTS's decay), and run.json names who set each setting. A random search refuses α's settings written as keywords
    or in a config made by hand, not a preset's keys"""
    import json
    from rnn_darts import cli
    from rnn_darts.learner import load_preset
    msg = "method gdas sets mode to 'first'; mode 'second' contradicts it"
    for make in (lambda: SearchConfig(method='gdas', mode='second'), lambda: SearchConfig(method='gdas').updated('search_learner', mode='second'),
                 lambda: tiny_learner(n_train=FAMILY, method='gdas', mode='second')):
        with pytest.raises(UsageError, match=msg): make()
    with pytest.raises(SystemExit) as e: cli.run_command(['search', '--method', 'gdas', '--mode', 'second', '--out', str(tmp_path/'no')])
    assert e.value.code == 2 and capsys.readouterr().err == "rnn-darts: error: --method gdas sets mode to 'first'; --mode 'second' contradicts it\n"
    c = SearchConfig(method='drnas', dirichlet_kl=5e-3)
    assert (c.relax, c.mode, c.dirichlet_kl, SearchConfig(method='beta-darts', beta_decay=10.).beta_decay) == ('drnas', 'first', 5e-3, 10.)
    assert {k: c.sources()[k] for k in ('method', 'dirichlet_kl', 'relax', 'mode', 'lr')} == dict(
        method='user', dirichlet_kl='user', relax='--method drnas', mode='--method drnas', lr='default')   # as run.json's sources say it
    assert SearchConfig(method='drnas').updated('search_learner', seed=1).dirichlet_kl == 1e-3   # the method's, kept through a change
    assert tiny_learner(n_train=FAMILY, method='drnas', dirichlet_kl=5e-3).arch_param_update.dirichlet_kl == 5e-3
    out = tmp_path/'drnas'
    cli.run_command(['search', '--data', 'numbers', '--n-train', '400', '--n-eval', '200', '--epochs', '1', '--bs', '8', '--bptt', '4', '--eval-bs', '4',
                     '--emsize', '8', '--nhid', '8', '--device', 'cpu', '--method', 'drnas', '--dirichlet-kl', '0.005', '--curvature', 'false', '--out', str(out)])
    info = json.loads((out/'run.json').read_text())
    assert info['settings']['dirichlet_kl'] == 0.005 and info['settings']['relax'] == 'drnas'
    assert {k: info['sources'].get(k) for k in ('dirichlet_kl', 'relax', 'mode', 'epochs', 'lr')} == dict(
        dirichlet_kl='flag', relax='--method drnas', mode='--method drnas', epochs='flag', lr=None)   # absent: the code's default
    dls = lm_dls(numbers_corpus(n_train=400, n_valid=200, n_test=200), 8, 4, 'search')
    with pytest.raises(UsageError, match='arch_lr applies to the architecture weights'): search_learner(dls, None, SearchConfig(mode='random', arch_lr=1e-3))
    search_learner(dls, None, SearchConfig.of(load_preset('quick')), mode='random', path=tmp_path)   # the preset's curvature_windows: not the user's word

# ------------------------------------------------------------------ SDARTS
class Mixes(Callback):
    "The mixing weights of every training forward, with softmax(α) at that moment: the weight steps' and the architecture passes'"
    order = 100
    def __init__(self): self.weight, self.arch = [], []
    def before_fit(self):
        m, rec = self.model, self
        orig = type(m).cell_inputs
        def spy(update_stats=True, stream=None):
            d = orig(m, update_stats, stream)
            if m.training: (rec.weight if update_stats else rec.arch).append((d['probs'].detach().clone(), F.softmax(m.alpha.detach(), -1)))
            return d
        m.cell_inputs = spy
    def after_fit(self): del self.model.cell_inputs

@functools.cache
def sdarts_fit(kind):
    "One epoch of 7 batches (bptt 5) under SDARTS's `kind` perturbation with its mixing weights recorded, made once per module (the adversarial one serves two tests)"
    rec = Mixes()
    learn = tiny_learner(perturb=kind, mode='first', n_train=280, n_valid=60, bptt=5)
    fit(learn, 1, [rec])
    return learn, rec

@pytest.mark.parametrize('kind', ['random', 'adversarial'])
def test_sdarts_perturbs_the_weight_step_only_within_its_bound(kind):
    learn, rec = sdarts_fit(kind)
    assert len(rec.arch) > 5 and len(rec.weight) > 5
    for p, clean in rec.arch: assert torch.equal(p, clean)          # α's passes: unperturbed
    for w, clean in rec.weight:
        torch.testing.assert_close(w.sum(-1), torch.ones(36))
        assert not torch.allclose(w, clean, atol=1e-4)                  # perturbed ...
        assert (w - clean).abs().max() <= 2 * 0.03 + 1e-6               # ... within the first epoch's ε (and the projection's renormalisation)
    assert learn.model.mixing_hook is None

def test_sdarts_adversarial_weights_raise_the_batch_loss():
    "The attacked mixing weights give the batch a loss at least the clean one's (in evaluation mode, as the attack measures it)"
    learn, _ = sdarts_fit('adversarial')
    cb, m = learn.perturbation, learn.model
    x, y = next(iter(learn.dls.train))
    cb.eps = 0.3
    m.eval()
    loss = cb.attack_loss(x, y)
    from rnn_darts.callbacks.perturb import pgd_mixing
    w = F.softmax(m.alpha.detach(), -1)
    p = pgd_mixing(loss, w, 0.3)
    with torch.no_grad(): assert float(loss(p)) >= float(loss(w))
    assert not torch.equal(p, w) and (p - w).abs().max() <= 2 * 0.3

# ------------------------------------------------------------------ DARTS-PT
from rnn_darts.pt_select import node_pairs_of, project, without
from rnn_darts.random_search import stream_loss
from rnn_darts.data import batchify

def test_darts_pt_keeps_per_node_the_pair_whose_removal_hurts_most():
    "Without fine-tuning the supernet does not change between decisions: each decision is checked again, pair by pair, with a plain loop"
    learn = tiny_learner(method='darts-pt', pt_tune=0, n_train=50, n_valid=40, bptt=2)   # 3 batches; each pair's loss: one 2-step pass over 13 rows
    fit(learn, 1)
    pt, m = learn.pt_selection, learn.model
    rec = pt.record['decisions']
    assert sorted(d['node'] for d in rec) == list(range(1, 9)) and pt.record['seconds'] > 0
    vdl = learn.dls.valid
    ids = vdl.data.reshape(-1)
    data = batchify(ids, len(ids) // (vdl.bptt + 1))
    m.eval()
    decided = {}
    for d in rec:
        node = d['node'] - 1
        losses = {}
        for e, k in node_pairs_of(node, 8):
            m.mixing_hook = lambda w: without(project(w, decided, 8), e, k)
            losses[(e, k)] = float(stream_loss(m, data, vdl.bptt))
        best = max(losses, key=losses.get)
        assert abs(losses[best] - d['loss_without']) < 1e-9 and len(set(losses.values())) > 1
        start = node * (node + 1) // 2
        assert (best[0] - start, best[1]) == (d['predecessor'], ['none', 'tanh', 'relu', 'sigmoid', 'identity'].index(d['op']))
        decided[node] = best
    assert [(op, p) for op, p in pt.chosen.recurrent] == [(d['op'], d['predecessor']) for d in sorted(rec, key=lambda d: d['node'])]

def test_darts_pt_runs_its_cell_after_and_then_the_supernet_again(tmp_path):
    "After the selection the model runs the chosen cell; a later fit trains the supernet again (that the selection repeats from its seed and resumes: tests/test_resume.py)"
    a = tiny_learner(method='darts-pt', pt_tune=1, n_train=50, n_valid=40, bptt=2); fit(a, 1)   # a batch of fine-tuning after each decision
    w = a.model.mixing_weights()
    for sl in edge_slices(8): assert w[sl].sum() == 1 and (w[sl] == 1).sum() == 1   # one-hot per node: the chosen cell
    class Hooks(Callback):
        def __init__(self): self.seen = []
        def before_batch(self):
            if self.training: self.seen.append(self.model.mixing_hook)
    rec = Hooks()
    fit(a, 1, [rec])                                                                  # a later fit trains the supernet again
    assert rec.seen and all(h is None for h in rec.seen)
    assert a.pt_selection.chosen is not None and a.model.mixing_hook is not None

@pytest.mark.slow
def test_the_command_line_writes_darts_pts_cell_and_its_time(tmp_path):
    import json
    from rnn_darts import cli
    from rnn_darts.genotypes import load_genotype
    out = tmp_path/'pt'
    cli.run_command(['search', '--data', 'numbers', '--n-train', '400', '--n-eval', '200', '--epochs', '1', '--bs', '8', '--bptt', '4', '--eval-bs', '4',
                     '--emsize', '8', '--nhid', '8', '--device', 'cpu', '--method', 'darts-pt', '--pt-tune', '1', '--curvature', 'false', '--out', str(out)])
    info = json.loads((out/'run.json').read_text())
    assert info['settings']['select'] == 'pt' and info['settings']['mode'] == 'first'
    assert info['pt_select']['seconds'] > 0 and len(info['pt_select']['decisions']) == 8
    g = load_genotype(out/'genotype.json')
    assert [(op, p) for op, p in g.recurrent] == [(d['op'], d['predecessor']) for d in sorted(info['pt_select']['decisions'], key=lambda d: d['node'])]

@pytest.mark.slow
def test_the_report_of_a_folder_of_searches_sets_the_methods_side_by_side(tmp_path, capsys):
    "`rnn-darts report FOLDER` over real searches: a row per run with its method, best and last perplexity, λ_max after each epoch as logged, its cell and a finite log; the figure"
    import csv
    from rnn_darts import cli
    from rnn_darts.genotypes import load_genotype
    from rnn_darts.genotypes import cell_text
    tiny = ['--data', 'numbers', '--n-train', '400', '--n-eval', '200', '--epochs', '2', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '8',
            '--nhid', '8', '--device', 'cpu']
    for m, kw in (('gdas', ['--curvature-windows', '1']), ('random', [])): cli.run_command(['search', *tiny, *kw, '--method', m, '--out', str(tmp_path/m)])
    capsys.readouterr()
    cli.run_command(['report', str(tmp_path)])
    assert capsys.readouterr().out.strip() == f"report written to {tmp_path/'report.md'}"
    rows = [r for r in (tmp_path/'report.md').read_text().splitlines() if r.startswith('| gdas') or r.startswith('| random')]
    gdas, rnd = [[c.strip() for c in r.strip('|').split('|')] for r in rows]
    with (tmp_path/'gdas'/'log.csv').open() as f: log = list(csv.DictReader(f))
    lams, ppl = [float(r['lambda_max']) for r in log], [float(r['perplexity']) for r in log]
    assert gdas[:5] == ['gdas', 'gdas', '2', f"{min(ppl):.2f}", f"{ppl[-1]:.2f}"] and len(lams) == 2
    assert gdas[5] == ' → '.join(f"{x:.3g}" for x in lams)
    assert gdas[6] == cell_text(load_genotype(tmp_path/'gdas'/'genotype.json')) and gdas[8:] == ['yes', 'yes']
    assert rnd[1] == 'random' and rnd[5] == '' and rnd[8:] == ['yes', 'yes']
    assert (tmp_path/'searches.png').read_bytes()[:4] == b'\x89PNG'

# ------------------------------------------------------------------ hot paths
from torch.utils._python_dispatch import TorchDispatchMode

class HostReads(TorchDispatchMode):
    "The operators that read a device value on the host (a sync on a GPU; a CUDA graph cannot hold them)"
    def __init__(self): super().__init__(); self.seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(k in str(func) for k in ('_local_scalar_dense', 'nonzero', 'is_nonzero')): self.seen.append(str(func))
        return func(*args, **(kwargs or {}))

@pytest.mark.parametrize('relax', DRAWN)
def test_a_drawn_relaxation_reads_nothing_on_the_host(relax):
    "Training, evaluation and the KL: no operator waits for the device (GDAS's index tensors are made once; Dirichlet's argument checks are off)"
    m = tiny(relax).float()
    if hasattr(m, 'tau'): m.tau.fill_(0.5)
    m.alpha.requires_grad_(True)
    m.mixing_weights('train')                          # the first call moves the index tensors to α's device
    with HostReads() as r:
        w = m.mixing_weights('train'); (w * torch.randn_like(w)).sum().backward()
        m.eval(); m.mixing_weights('valid'); m.arch_weights()
        if relax == 'drnas': penalty_grad(m.alpha, alpha_penalty(alpha_terms(kl=1e-3)))
    assert r.seen == [], r.seen

# ------------------------------------------------------------------ the Penn Treebank driver
FAKE_CLI = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
[ "$1" = report ] && { echo table > "$2/report.md"; exit 0; }
out=""; method=""
while [ $# -gt 0 ]; do case $1 in --out) out=$2;; --method) method=$2;; esac; shift; done
[ "$method" = bad ] && { echo "rnn-darts: error: planted" >&2; exit 1; }
mkdir -p "$out" && echo '{"finished": true}' > "$out/run.json"
"""

@pytest.mark.slow
def test_the_penn_treebank_driver_splits_resumes_and_goes_on_past_a_failure(tmp_path):
    """`tools/family-ptb.sh` (the README's family table), with `rnn-darts` replaced by a recorder: PTB's valid split trains and the
    halves of its test split validate and test; a finished run is skipped, any other folder resumed (even one killed before its
    first checkpoint), a new one started; a failed method neither stops the rest nor lets the report claim all are done"""
    import os, subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[1]/'tools'/'family-ptb.sh'
    penn, out, bin_ = tmp_path/'penn', tmp_path/'out', tmp_path/'bin'
    for d in (penn, bin_, out/'done', out/'killed'): d.mkdir(parents=True)
    (penn/'valid.txt').write_text('v1\nv2\nv3\n'); (penn/'test.txt').write_text('t1\nt2\nt3\nt4\nt5\n')
    (out/'done'/'run.json').write_text('{"finished": true}'); (out/'killed'/'log.csv').write_text('epoch,train_loss\n')
    (bin_/'rnn-darts').write_text(FAKE_CLI); (bin_/'rnn-darts').chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", CALLS=str(tmp_path/'calls'))
    def called(line):   # the method a search was called for, or the command
        w = line.split(); return w[w.index('--method') + 1] if '--method' in w else w[0]
    def drive(methods):
        (tmp_path/'calls').write_text('')
        r = subprocess.run(['bash', str(script), str(penn), str(out), '5', methods], capture_output=True, text=True, env=env, timeout=60)
        return r, {called(l): l for l in (tmp_path/'calls').read_text().splitlines()}
    r, calls = drive('done,killed,bad,new')
    assert r.returncode == 1 and 'not finished: bad' in r.stderr
    assert set(calls) == {'killed', 'bad', 'new'}                       # done skipped; no report after a failure
    assert '--resume' in calls['killed'] and '--resume' not in calls['new']
    assert all(f'--preset search --data {out/"corpus"}' in c and '--epochs 5' in c for c in calls.values())
    c = out/'corpus'
    assert [(c/f).read_text() for f in ('train.txt', 'valid.txt', 'test.txt')] == ['v1\nv2\nv3\n', 't1\nt2\n', 't3\nt4\nt5\n']
    r, calls = drive('done,killed,new')
    assert r.returncode == 0 and set(calls) == {'report'} and (out/'report.md').read_text() == 'table\n'
