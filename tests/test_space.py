"""The search space is the user's (issue 76): a set of ops (built in or registered), any number of nodes, through the
command line and Python; α's shape, the genotype, the run's files and the pictures follow the space; what cannot be
done in it is refused in one line; what was written before the space was data still loads, as the paper's."""
import json
import pytest, torch
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
from tests.test_arch import small_learner
from tests.test_cli_errors import NUM, fails

def swish(x): return x * torch.sigmoid(x)

def test_a_registered_op_is_searched_derived_trained_and_evaluated(tmp_path):
    "In Python: a user's op in a 3-node space; α's shape, the derived cell, its file and its training follow"
    register_op('swish', swish)
    learn, c = small_learner('first', ops=('tanh', 'swish', 'identity'), nodes=3)
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
    learn, _ = small_learner('first', ops=ops, nodes=steps)
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
    paper, _ = small_learner('first')
    old = {k: v for k, v in model_meta(paper.model).items() if k != 'ops'}
    check_meta(old, paper.model, 'old.pth')
    other, _ = small_learner('first', ops='tanh,relu,sigmoid,identity,gelu')
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
    (['train', '--genotype', 'DARTS_V2', '--ops', 'tanh,relu'], ['--ops: the genotype uses identity, sigmoid, which the set lacks (tanh, relu)']),
    (['train', '--genotype', 'DARTS_V2', '--nodes', '5'], ['--nodes 5: the genotype has 8 nodes']),
])
def test_a_space_the_run_cannot_have_is_one_line(capsys, argv, parts, tmp_path):
    fails(capsys, [*argv, *NUM, '--out', str(tmp_path/'run')], 2, *parts)

@pytest.mark.slow
def test_a_new_space_end_to_end_on_the_command_line(tmp_path, capsys):
    "search with gelu and 5 nodes, then train, evaluate and report; a resume in another space is refused, --override or not"
    out, ops = tmp_path/'search', ['tanh', 'relu', 'sigmoid', 'identity', 'gelu']
    cli.run_command(['search', *NUM, '--ops', ','.join(ops), '--nodes', '5', '--curvature', 'false', '--out', str(out)])
    g = json.loads((out/'genotype.json').read_text())
    assert g['ops'] == ops and len(g['recurrent']) == 5 and g['concat'] == [1, 2, 3, 4, 5]
    s = json.loads((out/'run.json').read_text())['settings']
    assert (s['ops'], s['nodes']) == (','.join(ops), 5)
    h = json.loads((out/'history.json').read_text())
    assert len(h[-1]['weights']) == 15 and len(h[-1]['weights'][0]) == 6
    same = ['--ops', ','.join(ops)]
    for flags, k in ((['--ops', 'tanh,relu', '--nodes', '5'], 'ops'), ([*same, '--nodes', '4'], 'nodes'), ([*same, '--nodes', '4', '--override', 'true'], 'nodes')):
        fails(capsys, ['search', *NUM, *flags, '--curvature', 'false', '--resume', '--epochs', '2', '--out', str(out)], 2,
              f"--resume: {out} ran --{k} ", "cannot go on in another (not even with --override)")
    capsys.readouterr()
    cli.run_command(['train', *NUM, '--genotype', str(out), '--out', str(tmp_path/'train')])
    assert 'test loss' in capsys.readouterr().out
    cli.run_command(['evaluate', str(out)])
    assert 'perplexity' in capsys.readouterr().out
    cli.run_command(['report', str(out)])
    from rnn_darts.plot import plot_alphas
    fig = plot_alphas(h)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == primitives(ops) and fig.winners.shape == (5, 1)
    text = (out/'report'/'report.md').read_text()
    assert 'gelu' in text and (out/'report'/'alphas.png').is_file()
