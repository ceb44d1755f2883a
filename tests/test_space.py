"""The search space is the user's (issue 76): a set of ops (built in or registered), any number of nodes, through the
command line and Python; α's shape, the genotype, the run's files and the pictures follow the space; what cannot be
done in it is refused in one line; what was written before the space was data still loads, as the paper's."""
import hashlib, json, math
import pytest, torch
from rnn_darts.space import SearchSpace
from rnn_darts.config import METHODS
from rnn_darts import cli
from rnn_darts.ops import OPS, PAPER_OPS, register_op
from rnn_darts.genotypes import (DARTS_V2, Genotype, check_in_space, derive_genotype, load_genotype, primitives,
                                 sample_genotype, save_genotype)
from rnn_darts.learner import evaluate, train_learner
from rnn_darts.relax import RELAXATION_CLASSES
from rnn_darts.callbacks.arch import op_param_counts
from rnn_darts.callbacks.checkpoint import check_meta, model_meta
from rnn_darts.pt_select import decided_genotype, node_pairs_of
from rnn_darts.random_search import draw_candidates, space_size
from rnn_darts.model import DartsRnnSearch
from tests.test_arch import SMALL
from tests._learners import tiny_learner
from tests._reference import plain_search_step, run_plain
from tests.test_cli_errors import NUM, fails

def swish(x): return x * torch.sigmoid(x)

def test_a_registered_op_is_searched_derived_trained_and_evaluated(tmp_path):
    "In Python: a user's op in a 3-node space; α's shape, the derived cell, its file and its training follow"
    register_op('swish', swish)
    learn = tiny_learner(mode='first', ops=('tanh', 'swish', 'identity'), nodes=3, **SMALL); c = learn.dls.corpus
    assert tuple(learn.model.alpha.shape) == (6, 4) and learn.model.cell.fns[2] is swish   # identity first, then tanh, swish
    with torch.no_grad(): learn.model.alpha[:, 2] = 3.   # swish wins every edge: the derived cell uses the user's op
    learn.fit(1)
    g = learn.model.genotype()
    assert len(g.recurrent) == 3 and {op for op, _ in g.recurrent} == {'swish'}
    save_genotype(g, tmp_path/'genotype.json', learn.model.ops)
    assert json.loads((tmp_path/'genotype.json').read_text())['ops'] == ['tanh', 'swish', 'identity']
    t = train_learner(learn.dls, tmp_path/'genotype.json', emsize=12, nhid=12, checkpoint=False, path=tmp_path)
    assert t.model.cell.acts == (swish,) * 3
    t.fit(1)
    assert torch.isfinite(torch.tensor(evaluate(t, t.dls.valid)['loss']))

def test_the_parts_of_the_family_follow_the_space():
    "GDAS's per-node draw, DARTS-PT's pairs and cell, the op decay, random search's draws: over α's columns, not the paper's five"
    ops, steps = ('relu', 'gelu', 'elu'), 3
    a = torch.randn(6, 4)
    w = RELAXATION_CLASSES['gdas'](steps, 4).evaluate(a)
    assert (w[:, 0] == 0).all() and [float(w[sl].sum()) for sl in (slice(0, 1), slice(1, 3), slice(3, 6))] == [1., 1., 1.]
    assert node_pairs_of(1, steps, 4) == [(e, k) for e in (1, 2) for k in (1, 2, 3)]
    assert decided_genotype({0: (0, 3), 1: (2, 2), 2: (3, 1)}, steps, ops) == Genotype((('elu', 0), ('gelu', 1), ('relu', 0)), (1, 2, 3))
    learn = tiny_learner(mode='first', ops=ops, nodes=steps, **SMALL)
    assert op_param_counts(learn.model).tolist() == [0.] + [12 * 24 + 1.] * 3
    cells = draw_candidates(20, steps, 0, ops)
    assert space_size(steps, ops) == 3**3 * 6 and all({op for op, _ in g.recurrent} <= set(ops) for g in cells)
    assert {op for _ in range(30) for op, _ in sample_genotype(steps, None, ops).recurrent} == set(ops)

def test_derive_refuses_weights_of_another_space():
    with pytest.raises(ValueError, match=r"a cell of 3 nodes over the ops tanh, relu, sigmoid, identity has \(6, 5\)"):
        derive_genotype(torch.rand(6, 6), 3)
    assert derive_genotype(torch.eye(6, 3)[:, [1, 0, 2]], ops=('gelu', 'silu')).recurrent[0] == ('gelu', 0)   # nodes from the rows

def test_written_before_the_space_was_data_loads_as_the_papers(tmp_path):
    "A genotype file without 'ops' is the paper's; a checkpoint's meta without 'ops' fits the paper's set and no other"
    (tmp_path/'g.json').write_text(json.dumps(dict(recurrent=[['relu', 0], ['tanh', 1]], concat=[1, 2])))
    assert load_genotype(tmp_path/'g.json') == Genotype((('relu', 0), ('tanh', 1)), (1, 2))
    paper = tiny_learner(mode='first', **SMALL)
    old = {k: v for k, v in model_meta(paper.model).items() if k != 'ops'}
    check_meta(old, paper.model, 'old.pth')
    other = tiny_learner(mode='first', ops='tanh,relu,sigmoid,identity,gelu', **SMALL)
    with pytest.raises(ValueError, match=r"old\.pth does not fit this model \(ops: checkpoint \['tanh', 'relu', 'sigmoid', 'identity'\], model \['tanh', 'relu', 'sigmoid', 'identity', 'gelu'\]\)"):
        check_meta(old, other.model, 'old.pth')

def test_a_genotype_file_with_an_op_its_set_lacks_is_refused(tmp_path):
    (tmp_path/'g.json').write_text(json.dumps(dict(recurrent=[['gelu', 0]], concat=[1], ops=['tanh', 'relu'])))
    with pytest.raises(ValueError, match=r"g\.json: node 1 uses op 'gelu', which its op set lacks \(tanh, relu\)"): load_genotype(tmp_path/'g.json')
    with pytest.raises(ValueError, match=r"the genotype uses gelu, which the set lacks \(tanh, relu\)"):
        check_in_space(Genotype((('gelu', 0),), (1,)), ('tanh', 'relu'))

@pytest.mark.parametrize('argv,parts', [
    (['search', '--ops', 'tanh,cosh'], ["--ops: unknown op 'cosh'; the ops are " + ', '.join(OPS)]),
    (['search', '--ops', 'none,tanh'], ["--ops: 'none' is every edge's implicit op"]),
    (['search', '--nodes', '0'], ['--nodes']),
    (['search', '--mode', 'random', '--edge-norm', 'true'], ['--edge-norm applies to the architecture weights α, which random search (mode random) does not have']),
    (['train', '--genotype', 'DARTS_V2', '--ops', 'tanh,relu'], ['--ops: the genotype uses identity, sigmoid, which the set lacks (tanh, relu)']),
    (['train', '--genotype', 'DARTS_V2', '--nodes', '5'], ['--nodes 5: the genotype has 8 nodes']),
])
def test_a_space_the_run_cannot_have_is_one_line(capsys, argv, parts, tmp_path):
    fails(capsys, [*argv, *NUM, '--out', str(tmp_path/'run')], 2, *parts)

# ---------------------------------------------------------------- edge normalisation (PC-DARTS's β)
def plain_edge_weights(beta, steps):
    "Per node, softmax of β over its incoming edges, written the plain way"
    out, start = [], 0
    for i in range(1, steps + 1): out.append(torch.softmax(beta[start:start + i], 0)); start += i
    return torch.cat(out)

@pytest.mark.parametrize('relax', ['softmax', 'sigmoid', 'gdas'])
def test_edge_normalisation_equals_plain(relax):
    "The cell's output under edge normalisation equals the plain cell mixing by relax(α) times the per-node softmax of β; and so do their gradients in α and β"
    torch.manual_seed(0)
    m = DartsRnnSearch(30, 6, 6, 0., 0., 0., 0., 0., relax=relax, space=SearchSpace(('tanh', 'gelu'), 3, True)).eval()
    assert tuple(m.alpha.shape) == (6, 4)
    with torch.no_grad(): m.alpha.normal_()
    m.alpha.requires_grad_(True)
    x, h0 = torch.randn(4, 5, 6), torch.randn(5, 6)
    out, _ = m.cell(x, h0, m.masks, 'valid', probs=m.mixing_weights('valid'), update_stats=False)
    r = RELAXATION_CLASSES[relax](3, 3)
    probs = r.evaluate(m.alpha[:, :3]) * plain_edge_weights(m.alpha[:, 3], 3)[:, None]
    fresh = lambda s: s / (1 + 1e-5) ** 0.5
    bn = lambda s, i: fresh(s) / fresh(s).pow(2).mean().sqrt().clamp(min=1)
    ref = run_plain(lambda xt, h: plain_search_step(xt, h, m.cell.W0, [m.cell.W(i) for i in (1, 2, 3)], probs, norm=bn, ops=('tanh', 'gelu')), x, h0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    ga, gr = (torch.autograd.grad(o.pow(2).sum(), m.alpha)[0] for o in (out, ref))
    assert ga[:, 3].abs().sum() > 0 or relax == 'gdas'
    torch.testing.assert_close(ga, gr, rtol=1e-4, atol=1e-6)

def test_edge_normalisation_derives_by_edge_weight_times_op_weight():
    "PC-DARTS's rule: node 2's edge from node 1 has the larger op weight, the edge from node 0 the far larger β: the edge from 0 wins"
    m = DartsRnnSearch(30, 6, 6, space=SearchSpace(('tanh', 'relu'), 2, True))
    with torch.no_grad():
        m.alpha.zero_()
        m.alpha[1, 1] = 1.; m.alpha[2, 2] = 2.   # node 2: tanh on edge 0→2, relu (stronger) on edge 1→2
        m.alpha[1, 3] = 3.                       # β of edge 0→2
    w = torch.softmax(m.alpha[:, :3], -1) * plain_edge_weights(m.alpha[:, 3], 2)[:, None]
    assert w[1, 1] > w[2, 2] and torch.softmax(m.alpha[1:3, :3], -1)[1, 2] > torch.softmax(m.alpha[1:3, :3], -1)[0, 1]
    assert m.genotype().recurrent[1] == ('tanh', 0)
    torch.testing.assert_close(m.arch_weights(), w)

def test_beta_hypergradient_first_order_equals_finite_differences():
    "∇β of the validation loss (first order), against central differences in float64"
    from rnn_darts.callbacks.arch import arch_grad, hypergrad
    learn = tiny_learner(mode='first', ops='tanh,relu,gelu', nodes=3, edge_norm=True, dropout=0., dropouth=0., dropoutx=0., dropouti=0., **SMALL); c = learn.dls.corpus
    m = learn.model.double()
    trn = val = next(iter(learn.dls.train))
    trn = tuple(t for t in trn)
    with torch.no_grad(): m.alpha.normal_()
    m.reset()
    g, _ = arch_grad(m, trn, val, lambda t, v: hypergrad(m, t, v, mode='first'))
    def loss():
        m.reset()
        with torch.no_grad(): return float(m.loss(*val, stream='search', advance=False, update_stats=False))
    eps = 1e-6
    for e in range(6):
        with torch.no_grad(): m.alpha[e, -1] += eps
        up = loss()
        with torch.no_grad(): m.alpha[e, -1] -= 2 * eps
        down = loss()
        with torch.no_grad(): m.alpha[e, -1] += eps
        assert abs((up - down) / (2 * eps) - float(g[e, -1])) <= 1e-6 + 1e-4 * abs(float(g[e, -1])), e

def test_beta_second_order_hypergradient_equals_the_exact_one():
    "The unrolled step's β part: with its finite-difference Hessian-vector product, as with autograd's double backward (exact), float64"
    from rnn_darts.callbacks.arch import arch_grad, hypergrad
    learn = tiny_learner(mode='second', ops='tanh,relu,gelu', nodes=3, edge_norm=True, dropout=0., dropouth=0., dropoutx=0., dropouti=0., **SMALL); c = learn.dls.corpus
    m = learn.model.double()
    it = iter(learn.dls.train); trn, val = next(it), next(it)
    with torch.no_grad(): m.alpha.normal_()
    def g(mode):
        m.reset()
        return arch_grad(m, trn, val, lambda t, v: hypergrad(m, t, v, mode=mode, lr=2., wd=0., clip=None))[0]
    fd, ex = g('second'), g('exact')
    assert ex[0, -1] == 0 and ex[1:, -1].abs().min() > 0   # node 1 has one edge: its weight is 1, whatever β
    assert torch.nn.functional.cosine_similarity(fd[:, -1], ex[:, -1], dim=0) >= 0.99   # as α's (tests/test_arch.py): finite differences are approximate

@pytest.mark.parametrize('method', [m for m in METHODS if m not in ('darts', 'random')])
def test_edge_normalisation_composes_with_every_method(method):
    "Each method (so each α step kind: second, first, exact, mixed, single) learns β beside α, one Adam over one tensor, its logs finite"
    learn = tiny_learner(mode=METHODS[method].get('mode', 'first'), method=method, ops='tanh,relu', nodes=3, edge_norm=True, pt_tune=1, **SMALL)
    before = learn.model.alpha.detach().clone()
    learn.fit(1)
    moved = (learn.model.alpha.detach() - before).abs()
    assert moved[1:, -1].min() > 0 and moved[:, :-1].max() > 0
    assert all(math.isfinite(v) for v in learn.recorder.values[-1])
    assert len(learn.model.genotype().recurrent) == 3

@pytest.mark.slow
def test_a_new_space_end_to_end_on_the_command_line(tmp_path, capsys):
    "search with gelu and 5 nodes, then train, evaluate and report; a resume in another space is refused, --override or not"
    out, ops = tmp_path/'search', ['tanh', 'relu', 'sigmoid', 'identity', 'gelu']
    cli.run_command(['search', *NUM, '--ops', ','.join(ops), '--nodes', '5', '--edge-norm', 'true', '--curvature', 'false', '--out', str(out)])
    g = json.loads((out/'genotype.json').read_text())
    assert g['ops'] == ops and len(g['recurrent']) == 5 and g['concat'] == [1, 2, 3, 4, 5]
    s = json.loads((out/'run.json').read_text())['settings']
    assert (s['ops'], s['nodes']) == (','.join(ops), 5)
    h = json.loads((out/'history.json').read_text())
    assert len(h[-1]['weights']) == 15 and len(h[-1]['weights'][0]) == 6
    same = ['--ops', ','.join(ops), '--nodes', '5', '--edge-norm', 'true']
    for flags, k in ((['--ops', 'tanh,relu', '--nodes', '5', '--edge-norm', 'true'], 'ops'), ([*same, '--nodes', '4'], 'nodes'),
                     ([*same, '--nodes', '4', '--override', 'true'], 'nodes'), ([*same, '--edge-norm', 'false'], 'edge_norm')):
        line = fails(capsys, ['search', *NUM, *flags, '--curvature', 'false', '--resume', '--epochs', '2', '--out', str(out)], 2,
                     f"--resume: {out} ran --{k.replace('_', '-')} ", "cannot go on in another (not even with --override)")
        if k == 'edge_norm': assert '--edge-norm true, not false' in line   # as the flag takes it, not True/False
    err = fails(capsys, ['search', '--ops', 'tanh,relu', '--nodes', '4', '--resume', '--out', str(out)], 2, f"--resume: {out} ran ")
    assert f"--ops {','.join(ops)!r}, not 'tanh,relu', --nodes 5, not 4" in err and 'drop those flags' in err   # every difference at once
    cli.run_command(['search', *NUM, '--ops', ','.join(reversed(ops)), '--curvature', 'false', '--resume', '--epochs', '2', '--out', str(out)])
    assert json.loads((out/'run.json').read_text())['settings']['ops'] == ','.join(ops)   # the same ops in another order: the run's order goes on
    cli.run_command(['train', *NUM, '--genotype', str(out), '--out', str(tmp_path/'train')])
    assert 'test loss' in capsys.readouterr().out
    cli.run_command(['evaluate', str(out)])
    assert 'perplexity' in capsys.readouterr().out
    cli.run_command(['report', str(out)])
    from rnn_darts.plot import plot_alphas
    fig = plot_alphas(h)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == primitives(ops) and fig.winners.shape == (5, 1)
    assert "softmax(α) × the edge's weight (β)" in [a.get_ylabel() for a in fig.axes]   # what the heatmap shows under edge normalisation
    text = (out/'report'/'report.md').read_text()
    assert 'gelu' in text and (out/'report'/'alphas.png').is_file()

PLUGIN = "import torch\nfrom rnn_darts.ops import register_op\nregister_op('swish', lambda x: x * torch.sigmoid(x))\n"

@pytest.mark.slow
def test_an_imported_op_reaches_every_command_and_its_run_imports_it_again(tmp_path, capsys):
    """`--import plugin.py` brings a user's op to `search`; `train --genotype RUN` and `report RUN` import it again from
    run.json without the flag, and say so (and that the file changed); with the file gone, the cell's op is refused in
    one line naming it and --import (exit 2). An installed package's `rnn_darts.ops` entry point adds its op with no
    flag. A missing or failing import: one line. Fresh processes: the registry is a process's; ~40 s"""
    import os, subprocess, sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    site = tmp_path/'site'; site.mkdir()   # an installed package: its module and its dist-info's entry point
    (site/'cubeops.py').write_text("import torch\nfrom rnn_darts.ops import register_op\nregister_op('cube', lambda x: x * x * x / 8)\n")
    (site/'cubeops-0.1.dist-info').mkdir()
    (site/'cubeops-0.1.dist-info'/'METADATA').write_text("Metadata-Version: 2.1\nName: cubeops\nVersion: 0.1\n")
    (site/'cubeops-0.1.dist-info'/'entry_points.txt').write_text("[rnn_darts.ops]\ncube = cubeops\n")
    env = {**{k: v for k, v in os.environ.items() if k != 'RNN_DARTS_IMPORT'}, 'PYTHONPATH': f"{root}{os.pathsep}{site}"}
    def rnn(*argv):
        r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *map(str, argv)], cwd=tmp_path, env=env, capture_output=True, text=True)
        return r.returncode, r.stdout, r.stderr
    plugin, run = tmp_path/'plugin.py', tmp_path/'run'
    plugin.write_text(PLUGIN)
    code, out, err = rnn('search', *NUM, '--import', 'plugin.py', '--ops', 'swish', '--nodes', '2', '--curvature', 'false', '--out', run)
    assert code == 0, err
    info = json.loads((run/'run.json').read_text())
    assert info['imports'] == [dict(name=str(plugin), file=str(plugin), sha256=hashlib.sha256(PLUGIN.encode()).hexdigest())]
    assert [op for op, _ in json.loads((run/'genotype.json').read_text())['recurrent']] == ['swish', 'swish']
    code, out, err = rnn('train', *NUM, '--genotype', run, '--out', tmp_path/'train')
    assert code == 0, err
    assert f"imported {plugin}, as {run/'run.json'} records\n" in out and 'test loss' in out
    plugin.write_text(PLUGIN + "# changed\n")
    code, out, err = rnn('report', tmp_path/'train')   # the training's run.json records the import too
    assert code == 0, err
    assert f"imported {plugin}, as {tmp_path/'train'/'run.json'} records: it has changed since the run" in out
    plugin.unlink()
    code, out, err = rnn('train', *NUM, '--genotype', run, '--out', tmp_path/'t2')
    assert code == 2 and err.count('\n') == 1 and "unknown op 'swish'" in err and '--import MODULE_OR_FILE' in err, err
    assert f"{run/'run.json'} imported {plugin}, which is gone" in out and not (tmp_path/'t2').exists()
    code, out, err = rnn('train', *NUM, '--genotype', '{"recurrent": [["cube", 0]], "concat": [1]}', '--epochs', '1', '--out', tmp_path/'t3')
    assert code == 0, err   # the entry point's op, no flag
    for spec, code, said in (('nope.py', 2, 'nope.py: no such file'), ('no_such_mod', 2, "no module named 'no_such_mod'"),
                             (str(site/'cubeops-0.1.dist-info'/'METADATA'), 2, 'not a .py file')):
        fails(capsys, ['search', '--import', spec, '--out', str(tmp_path/'x')], code, f"--import {spec}", said)
    (tmp_path/'bad.py').write_text("raise RuntimeError('not today')\n")
    fails(capsys, ['report', str(run), '--import', str(tmp_path/'bad.py')], 1, f"--import {tmp_path/'bad.py'}: importing it failed: RuntimeError: not today")

def test_the_space_is_one_value_from_the_keywords_to_the_model():
    "A search learner's `ops`, `nodes` and `edge_norm` keywords become one `SearchSpace`, its config's and its model's; α has its shape"
    learn = tiny_learner(mode='first', ops=' tanh, gelu', nodes=3, edge_norm=True, **SMALL)
    space = SearchSpace(('tanh', 'gelu'), 3, True)
    assert learn.config.space == space and learn.model.space == space and learn.config.ops == 'tanh,gelu'
    assert tuple(learn.model.alpha.shape) == (space.edges, 1 + len(space.ops) + 1)   # none, the ops, β

def test_a_space_refuses_what_cannot_be_one():
    "A space without ops is refused; random search with weight sharing (no α, so no β) refuses edge normalisation"
    from rnn_darts.model import DartsRnnShared
    with pytest.raises(ValueError, match='a search space needs one op or more'): SearchSpace(ops='')
    with pytest.raises(ValueError, match='no α, so no β'): DartsRnnShared(30, 6, 6, space=SearchSpace(nodes=2, edge_norm=True))
    assert DartsRnnShared(30, 6, 6, space=SearchSpace(nodes=2)).space.nodes == 2
