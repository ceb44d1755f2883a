"""One execution plan (issue 67): every rule of `rnn_darts.engine.plan.RULES` answers the same through what users run, the
command line, the learners and bench: a refused combination is one line (exit 2, or a `UsageError` naming the
keyword), a fallback is one line said once, and `run.json` records what ran, not what was asked."""
import json
import pytest
from rnn_darts import cli
from rnn_darts.core import UsageError
from rnn_darts.engine.plan import RULES, plan_of
from rnn_darts.learner import search_learner
from rnn_darts.data import numbers_corpus, lm_dls, search_stream
from tests.test_cli_errors import NUM, fails

REFUSED = {   # rule -> the flags that meet it on this CPU
    'fuse needs a GPU': ['--fuse', 'true'],
    'fuse is fp32 or tf32': ['--fuse', 'true', '--precision', 'bf16'],
    'compile, not random search': ['--mode', 'random', '--compile', 'true'],
    'graphs, not random search': ['--mode', 'random', '--graphs', 'true'],
    'graphs, not bf16': ['--graphs', 'true', '--precision', 'bf16'],
}
FALLBACKS = {'graphs need a GPU': ['--graphs', 'true'], 'tf32 needs tensor cores': ['--precision', 'tf32']}
ELSEWHERE = {   # rules a CPU and one process cannot meet, and where they are proven
    'bf16 needs bfloat16': 'a GPU without bfloat16 (plan_of with a stand-in below)',
    'fuse needs Triton': 'a GPU without Triton (plan_of with a stand-in below)',
    'graphs, one process': 'several processes (plan_of with world=2 below)',
    'graphs need the fused loss': 'a Python-only setting (fused_loss=False, below)',
    'fuse runs its ops': 'a GPU with Triton (plan_of with a stand-in below)',
    'bf16 products pay here': 'a CPU without bf16 products (a stand-in for its measurement below)',
}

def test_every_rule_of_the_table_is_proven_here():
    "A rule added to the table without a case here fails this test"
    assert {r.name for r in RULES} == set(REFUSED) | set(FALLBACKS) | set(ELSEWHERE)
    assert all(r.verdict == 'refused' for r in RULES if r.name in REFUSED) and all(r.verdict == 'falls back' for r in RULES if r.name in FALLBACKS)

@pytest.mark.parametrize('rule', list(REFUSED))
def test_a_refused_combination_is_one_line_on_the_command_line_and_in_python(rule, capsys):
    flags = REFUSED[rule]
    line = fails(capsys, ['search', *NUM, *flags], 2)
    want = next(r for r in RULES if r.name == rule).why(dict(name=lambda k: '--' + k.replace('_', '-'), device=None))
    assert line == f"rnn-darts: error: {want}" if 'device' not in want else line.startswith('rnn-darts: error: ' + want.split(';')[0])
    kw = {flags[i].lstrip('-'): {'true': True}.get(flags[i + 1], flags[i + 1]) for i in range(0, len(flags), 2)}
    c = numbers_corpus(n_train=600, n_valid=300, n_test=300)
    with pytest.raises(UsageError) as e:
        search_learner(lm_dls(c, 8, 10, 'search'), search_stream(c, 8), emsize=8, nhid=8, device='cpu', checkpoint=False, **kw)
    assert str(e.value) == line.removeprefix('rnn-darts: error: ').replace('--', ''), (str(e.value), line)

@pytest.mark.slow
def test_fallbacks_are_said_once_and_run_json_records_what_ran(tmp_path, capsys):
    out = tmp_path/'run'
    cli.run_command(['search', *NUM, '--curvature', 'false', *FALLBACKS['graphs need a GPU'], *FALLBACKS['tf32 needs tensor cores'], '--out', str(out)])
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith('search mode second, relax softmax on ') and 'batches: compiling would not pay), fp32); run folder' in said[0], said[0]   # method, mode, path
    for line in ('CUDA graphs off: they need a GPU, and the device is cpu; the steps run eager',
                 "--precision tf32: TF32 is a mode of NVIDIA GPUs' tensor cores, and the device is cpu; the products run in fp32"):
        assert said.count(line) == 1, said
    info = json.loads((out/'run.json').read_text())
    assert info['settings']['precision'] == 'tf32' and info['settings']['graphs'] is True   # what was asked
    assert {k: info['plan'][k] for k in ('precision', 'graphs', 'compile', 'path')} == dict(precision='fp32', graphs=False, compile=False, path='eager (37 batches: compiling would not pay), fp32')   # what ran, and why: too short a fit to compile
    assert len(info['plan']['notes']) == 2

def test_the_rules_a_cpu_cannot_meet(monkeypatch):
    """bf16 on a GPU without it, and fuse on one without Triton, are refused; an op without Triton forms turns fuse off
    with one line naming it (any set of ops with forms fuses, search and train alike); several processes and an unfused
    loss turn graphs off with one line; the defaults on CUDA"""
    import torch
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: False)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None: 'Old GPU')
    with pytest.raises(UsageError, match='precision bf16: the GPU Old GPU does not support bfloat16; use fp32 or tf32'): plan_of(dict(precision='bf16'), 'cuda')
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'triton' else find_spec(name, *a))
    with pytest.raises(UsageError, match="fuse true runs Triton kernels, and Triton is not installed"): plan_of(dict(fuse=True), 'cuda')
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: object() if name == 'triton' else find_spec(name, *a))
    for command in ('search', 'train'):   # the search kernels mix any set of ops with Triton forms, in any order; a derived cell's run any
        for ops in ('tanh,relu,sigmoid,identity,gelu', 'relu,tanh,sigmoid,identity', ('gelu', 'silu', 'elu', 'softplus', 'leaky_relu', 'identity')):
            p = plan_of(dict(fuse=True, ops=ops), 'cuda', world=1, command=command)
            assert p.fuse is True and p.notes == (), (command, ops, p.notes)
    from rnn_darts.ops import OPS, register_op
    register_op('cube', lambda x: x * x * x)   # a user's op without Triton forms: the plan falls back, naming it
    try:
        for command in ('search', 'train'):
            p = plan_of(dict(fuse=True, ops=('relu', 'cube', 'gelu')), 'cuda', world=1, command=command)
            assert p.fuse is False and p.notes == ("fuse off: the fused kernels have no Triton form of cube (ops); the steps run unfused",), p.notes
    finally: del OPS['cube']
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: True)   # a GPU with bf16, for the defaults below
    assert plan_of(dict(graphs=True), 'cuda', world=2).notes == ('CUDA graphs off: not with several processes yet; the steps run eager',)
    p = plan_of(dict(graphs=True, fused_loss=False), 'cuda', world=1)
    assert p.graphs is False and 'fused decoder loss' in p.notes[0]
    assert plan_of(dict(), 'cuda', world=1).path == 'compiled + CUDA graphs, fp32'   # the defaults on a GPU
    assert plan_of(dict(precision='bf16'), 'cuda', world=1).graphs is False      # not asked, not captured: bf16's cache

def test_bf16_runs_as_fp32_on_a_cpu_whose_bf16_products_do_not_pay(monkeypatch):
    """Where this CPU's bf16 products measured under 1.5× float32's rate (`kernels.bf16_gain`), bf16 falls back to fp32
    with one line, for the plan, the learners' callbacks and a hand-built `BF16Autocast`; where they pay, it runs"""
    import torch
    from types import SimpleNamespace
    from rnn_darts.engine import kernels
    from rnn_darts.engine.speed import BF16Autocast
    from rnn_darts.model import DartsRnnSearch
    for gain, precision in ((0.8, 'fp32'), (1.6, 'bf16')):
        monkeypatch.setattr(kernels, 'bf16_gain', lambda: gain)
        p = plan_of(dict(precision='bf16'), 'cpu', world=1)
        assert p.precision == precision and p.notes == (() if gain > 1.5 else
            ("precision bf16 off: this CPU's bf16 products measured 0.80× float32's rate, and bf16 runs from 1.5×; the steps run in fp32",)), p.notes
        corpus = numbers_corpus(0, n_train=400, n_valid=100, n_test=100)
        learn = search_learner(lm_dls(corpus, 4, 6, device='cpu'), search_stream(corpus, 4, device='cpu'), precision='bf16', emsize=8, nhid=8, checkpoint=False)
        assert learn.plan.precision == precision and any(isinstance(cb, BF16Autocast) for cb in learn.cbs) == (precision == 'bf16')
        cb = BF16Autocast()   # by hand: it autocasts only where the plan runs bf16
        cb.learn = SimpleNamespace(model=DartsRnnSearch(20, 8, 8), cbs=[cb], loss_func=None)
        cb.before_fit()
        with cb.autocast: assert torch.is_autocast_enabled('cpu') == (precision == 'bf16')
