"The tests' plain reference (`tests/_reference.py`) computes the same math as ours; run_bench returns well-formed results."
import json, math
import pytest, torch
from rnn_darts.model import DartsRnnSearch
from rnn_darts.engine.runners import Compiled
from rnn_darts.engine.bench import run_bench, print_table, search_step, arch_updater, _batches, STEP_NAMES, FAMILY
from tests._reference import PlainSearchStep, plain_from, plain_hypergrad_first, plain_hypergrad_second
from rnn_darts.callbacks.arch import hypergrad_first, hypergrad_second, fd_hvp, exact_hvp
from tests._devices import ON_DEVICES

NO_DROP = dict(dropout=0, dropouth=0, dropoutx=0, dropouti=0)

def pair(seed=0, ntoken=30, nhid=6):
    torch.manual_seed(seed)
    m = DartsRnnSearch(ntoken, nhid, nhid, **NO_DROP).double().train()
    with torch.no_grad(): m.alpha.normal_(0, 0.5)        # away from uniform: op weights differ
    m.alpha.requires_grad_(True)
    return m, plain_from(m)

def test_plain_forward_equals_ours():
    m, p = pair()
    x = _batches(30, 3, 5, 1, 'cpu', 0)[0][0]
    torch.testing.assert_close(p(x)[0], m(x)[0])

def test_plain_first_order_equals_ours():
    m, p = pair(1)
    trn, val = _batches(30, 3, 4, 2, 'cpu', 1)
    with m.frozen_masks(): g, l = hypergrad_first(m, trn, val)
    p.bn_update = False
    q, lq, _ = plain_hypergrad_first(p, val, None)
    torch.testing.assert_close(lq, l)
    torch.testing.assert_close(q, g)
    assert g.abs().max() > 0

@pytest.mark.parametrize('clip', [0.25, 1e3])   # clipped, and not clipped
def test_plain_second_order_equals_ours(clip):
    m, p = pair(2)
    trn, val = _batches(30, 3, 4, 2, 'cpu', 2)
    w0, bn0 = m.flat.data.clone(), m.cell.bn.running_mean.clone()
    with m.frozen_masks(): g, l = hypergrad_second(m, trn, val, 2., 5e-7, clip, fd_hvp)
    assert torch.equal(m.flat.data, w0) and torch.equal(m.cell.bn.running_mean, bn0)
    p.bn_update = False
    q, lq, _ = plain_hypergrad_second(p, trn, val, None, None, 2., 5e-7, clip)
    torch.testing.assert_close(lq, l)
    torch.testing.assert_close(q, g, rtol=1e-5, atol=1e-9)
    # and both are the exact hypergradient up to the finite-difference error
    m.reset()
    with m.frozen_masks(): e, _ = hypergrad_second(m, trn, val, 2., 5e-7, clip, exact_hvp)
    assert torch.nn.functional.cosine_similarity(q.flatten(), e.flatten(), dim=0) > 0.99

def test_plain_step_matches_ours_over_a_few_steps():
    "A whole search step (arch step, Adam on α, clipped SGD weight step) moves both models the same way"
    m, p = pair(3)
    m.alpha.requires_grad_(False)
    cb, step = arch_updater(m), PlainSearchStep(p, 'second')
    trn, val = _batches(30, 3, 4, 2, 'cpu', 3)
    for _ in range(2):
        search_step(m, cb, trn, val, 'second'); step(trn, val)
    torch.testing.assert_close(p.alpha.detach(), m.alpha.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(p.W0.detach(), m.cell.W0, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(p.bn.running_var, m.cell.bn.running_var)

def test_run_bench_tiny(tmp_path, capsys):
    tiny = dict(bs=3, bptt=4, nhid=6, ntoken=40)
    res = run_bench(small=True, device='cpu', iters=1, warmup=0, shape=tiny, train_shape=dict(tiny, nhid=8), eval_bs=2,
                    modes=('second', 'first', 'exact', 'weight', 'random'), json_path=tmp_path/'b.json',
                    baseline=lambda m, mode: PlainSearchStep(plain_from(m), mode))   # the reference, timed beside ours
    assert {'device', 'device_name', 'torch', 'threads', 'small', 'iters', 'warmup', 'mem_kind', 'shapes', 'rows',
            'ratios'} <= set(res)
    assert res['device'] == 'cpu' and res['shapes']['search'] == tiny and res['shapes']['eval_bs'] == 2
    impls = [(r['name'], r['impl']) for r in res['rows']]
    assert len(impls) == 5 + 2 + len(FAMILY) + 1 + 2 and sum(i == 'base' for _, i in impls) == 2
    assert [n for n, _ in impls if n.startswith('search step, ') and n[13:] in FAMILY] == [f"search step, {m}" for m in FAMILY]
    assert set(res['method_ratios']) == set(FAMILY) and all(v > 0 for v in res['method_ratios'].values())
    for r in res['rows']:
        assert {'name', 'impl', 'bs', 'bptt', 'nhid', 'ntoken', 'ms', 'ms_min', 'tok_s', 'mem_mb', 'ops'} <= set(r)
        assert r['ms'] > 0 and r['ms_min'] > 0 and r['tok_s'] > 0 and r['mem_mb'] > 0 and r['ops'] > 0
        assert r['first_ms'] is None   # no warm-up call
    ops = {(r['name'], r['impl']): r['ops'] for r in res['rows']}
    for mode in ('second', 'first'):   # the plain code asks the device for over 5x as many operators (launches on a GPU)
        assert ops[STEP_NAMES[mode], 'base'] > 5 * ops[STEP_NAMES[mode], 'ours']
    assert set(res['ratios']) == set(res['ratios_min']) == {'second', 'first'} and all(v > 0 for v in res['ratios'].values())
    assert json.loads((tmp_path/'b.json').read_text())['rows'] == res['rows']
    print_table(res)
    out = capsys.readouterr().out
    assert 'baseline / ours' in out and 'ms/batch' in out and 'sdarts-adv / first-order DARTS, a search step: ' in out
    from rnn_darts.engine import kernels
    if kernels.ONEDNN:   # the kernels each product shape ran in, measured here; the decoder's (40 words, nhid 6) among them
        cs = res['kernels']['choices']
        assert any('40x6' in c['product'] for c in cs), cs
        assert all(c['kernel'] == min(('onednn', 'aten'), key=lambda k: c[f"{k}_us"]) for c in cs)
        assert f"CPU kernels chosen: oneDNN for {sum(c['kernel'] == 'onednn' for c in cs)} of {len(cs)} product shapes" in out
        assert cs[0]['product'] in out and res['kernels']['machine'] == kernels.machine_key()

def test_run_bench_options():
    tiny = dict(bs=2, bptt=3, nhid=4, ntoken=20)
    res = run_bench(small=True, iters=1, warmup=0, shape=tiny, modes=('first',), methods=(), train=False, evaluate=False)
    assert [r['impl'] for r in res['rows']] == ['ours'] and res['ratios'] == {} and res['method_ratios'] == {}
    res = run_bench(small=True, iters=1, warmup=1, shape=tiny, modes=('first',), methods=(), train=False, evaluate=True, profile=True)
    from rnn_darts.engine.bench import profile_text
    assert all(r['profile']['kernels'] > 0 and r['profile']['top'] for r in res['rows'])   # each row: one more call, profiled
    text = profile_text(res)
    assert all(f"{r['name']} (ours): {r['profile']['kernels']} kernels, busy " in text for r in res['rows']), text
    with pytest.raises(ValueError, match='unknown modes'): run_bench(modes=('fourth',))
    with pytest.raises(ValueError, match='unknown methods'): run_bench(methods=('darts-pt',))

@ON_DEVICES
def test_run_bench_bf16_times_and_measures_agreement(capsys, device):
    tiny = dict(bs=3, bptt=4, nhid=6, ntoken=40)
    res = run_bench(small=True, device=device, iters=1, warmup=0, shape=tiny, modes=('first', 'second'), train=False,
                    evaluate=False, precision='bf16')
    assert res['device'] == device
    assert res['precision'] == 'bf16' and set(res['precision_agreement']) == {'first', 'second'}
    ag = res['precision_agreement']
    for v in ag.values(): assert -1 - 1e-6 <= v['min'] <= v['mean'] <= 1 + 1e-6 and 0 < v['rel_mean'] <= v['rel_max']
    # the bf16 picture at initialisation, at this tiny shape: first order keeps its direction (measured 0.9995), so
    # does second order (measured mean 0.993, min 0.986). It read -0.08 while the autocast cast cache kept a stale bf16
    # copy of the tied decoder weight across the in-place weight moves: precision_agreement turns the cache off
    if device == 'cuda':   # the GPU tier prints the agreement it measured, whatever it is
        with capsys.disabled(): print(f"\nbf16 vs fp32 hypergradient cosine on {torch.cuda.get_device_name()}: {ag}")
    assert ag['first']['min'] > 0.99 and ag['second']['mean'] > 0.95
    print_table(res)
    assert 'bf16 vs fp32 hypergradient' in capsys.readouterr().out

def test_op_count_counts_what_reaches_the_device():
    from rnn_darts.engine.bench import op_count
    x = torch.randn(4, 3, requires_grad=True)
    assert op_count(lambda: x.view(12).t().detach()) == 0                     # views launch nothing
    assert op_count(lambda: torch.sigmoid(x.view(3, 4) * 2).sum()) == 3       # mul, sigmoid, sum
    assert op_count(lambda: (x * 2).sum().backward()) > 2                      # the backward pass counts too

def test_bf16_agreement_is_one_when_both_sides_are_fp32(monkeypatch):
    "With the bf16 autocast switched off both sides are the same fp32 computation: cosine 1, difference 0 (same masks, same streams)"
    from rnn_darts.engine import bench
    from rnn_darts.model import DartsRnnSearch
    torch.manual_seed(0)
    m = DartsRnnSearch(40, 6, 6, **bench.SEARCH_DROPOUTS).train()
    batches = [bench._batches(40, 3, 4, 2, 'cpu', i) for i in range(2)]
    real = torch.autocast
    monkeypatch.setattr(bench.torch, 'autocast', lambda *a, **k: real(*a, **{**k, 'enabled': False}))
    for v in bench.precision_agreement(m, batches, 'bf16', ('first', 'second')).values():
        assert abs(v['min'] - 1) < 1e-6 and abs(v['mean'] - 1) < 1e-6 and v['rel_max'] == 0

@pytest.mark.gpu
def test_tf32_changes_the_products_on_a_gpu_and_says_by_how_much(capsys):
    "On an Ampere or newer GPU, TF32 products move the hypergradient a little from fp32's (on a CPU it is the same computation: 10_bench)"
    from rnn_darts.engine import bench
    from rnn_darts.engine.plan import tf32_missing
    from rnn_darts.model import DartsRnnSearch
    if not torch.cuda.is_available() or tf32_missing('cuda'): pytest.skip(tf32_missing('cuda') or 'no GPU here')
    torch.manual_seed(0)
    m = DartsRnnSearch(1000, 64, 64, **bench.SEARCH_DROPOUTS).cuda().train()
    ag = bench.precision_agreement(m, [bench._batches(1000, 16, 20, 2, 'cuda', i) for i in range(3)], 'tf32', ('first', 'second'))
    with capsys.disabled(): print(f"\ntf32 vs fp32 hypergradient on {torch.cuda.get_device_name()}: {ag}")
    assert all(0 < v['rel_mean'] and math.isfinite(v['rel_max']) for v in ag.values())

def test_launch_count_agrees_with_op_count_on_eager_code():
    "The profiler-based counter (the one that can see into compiled graphs) counts an eager step as op_count does"
    from rnn_darts.engine.bench import op_count, launch_count, weight_step, SEARCH_DROPOUTS
    x = torch.randn(4, 3, requires_grad=True)
    assert launch_count(lambda: x.view(12).t().detach()) == dict(generated=0, library=0, total=0)
    assert launch_count(lambda: torch.sigmoid(x.view(3, 4) * 2).sum())['total'] == 3      # nested calls count once
    torch.manual_seed(0)
    m = DartsRnnSearch(30, 8, 8, **SEARCH_DROPOUTS).train()
    trn = _batches(30, 4, 5, 1, 'cpu', 0)[0]
    f = lambda: weight_step(m, *trn)
    f()
    n, lc = op_count(f), launch_count(f)
    assert lc['generated'] == 0 and abs(lc['total'] - n) <= 0.05 * n, (lc, n)

def test_launch_count_keeps_the_profiler_log_off_stderr(capfd):
    "kineto's own lines (`USDT: ... profiler_start`, `ERROR: ... gpuGetDeviceCount`) stay off stderr; what the counted code writes there passes"
    import sys
    from rnn_darts.engine.bench import launch_count
    def f():
        print('planted line from the counted code', file=sys.stderr)
        return torch.ones(3).sum()
    launch_count(f)
    err = capfd.readouterr().err
    assert err == 'planted line from the counted code\n', err

@pytest.mark.slow
def test_launch_count_of_a_compiled_step():
    """Compiled under kernel_profile(), a weight step launches generated kernels plus library calls (matmuls), far fewer than
    eager. A 3-node derived cell's step: the counter is the point, and kernel_profile compiles without Inductor's caches (the
    search cell's step took 137 s of a cold compile on 2 cores, DARTS_V2's 46 s, this one's about 25 s)"""
    from rnn_darts.engine.bench import op_count, launch_count, kernel_profile, weight_step
    from rnn_darts.model import DartsRnn
    from rnn_darts.genotypes import Genotype
    torch.manual_seed(0)
    cell = Genotype(recurrent=[('sigmoid', 0), ('relu', 1), ('tanh', 1)], concat=range(1, 4))
    m = DartsRnn(30, cell, 8, 8, dropout=0.1, dropouth=0.1, dropoutx=0.1, dropouti=0.1).train()
    trn = _batches(30, 4, 5, 1, 'cpu', 0)[0]
    f = lambda: weight_step(m, *trn)
    f()
    eager = op_count(f)
    m.runner = Compiled(m.cell)
    with kernel_profile(): f(); f()        # compiled here: the kernels are recorded
    lc = launch_count(f)
    assert lc['generated'] >= 2 * 5 and lc['library'] >= 2 * 5 * 5, lc   # ≥ 2 kernels and 5 matmuls per step, fwd + bwd
    assert lc['total'] < eager / 2, (lc, eager)

def test_time_fn_and_time_pair_report_the_first_call_apart():
    "The warm-up's first call (where a compiled step compiles) is reported as `first_ms`, and kept out of the timed mean"
    import time
    from rnn_darts.engine.bench import time_fn, time_pair
    def slow_once():
        calls = []
        def f():
            if not calls: time.sleep(0.2)
            calls.append(1)
        return f
    t = time_fn(slow_once(), iters=3, warmup=2)
    assert t['first_ms'] >= 200 and t['ms'] < 100
    ta, tb = time_pair(slow_once(), lambda: None, iters=2, warmup=1)
    assert ta['first_ms'] >= 200 and ta['ms'] < 100 and tb['first_ms'] < 100
    assert time_fn(slow_once(), iters=1, warmup=0)['first_ms'] is None

@pytest.mark.slow
def test_the_gpu_check_runs_every_stage_and_reports_on_a_machine_without_a_gpu(tmp_path):
    "tools/gpu-check.sh on a CPU: every stage runs under its limit and reports its exit; the GPU tier skips, CUDA runs are refused"
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    import os, sys
    r = subprocess.run(['bash', str(root/'tools'/'gpu-check.sh'), str(tmp_path/'out')], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    for stage in ('versions', 'check', 'gpu-tier', 'quick-search', 'bench-graphed'):
        assert f'== {stage} (at most ' in r.stdout and f'== {stage}: exit ' in r.stdout, stage
        assert (tmp_path/'out'/f'{stage}.log').is_file()
    assert 'no CUDA device visible' in r.stdout and 'torch' in (tmp_path/'out'/'versions.log').read_text()
    assert ' skipped' in (tmp_path/'out'/'gpu-tier.log').read_text()
    for stage in ('check', 'bench-graphed', 'quick-search'): assert '--device cuda: CUDA was asked for' in (tmp_path/'out'/f'{stage}.log').read_text()
    assert r.stdout.index('== check (') < r.stdout.index('== gpu-tier (')   # the proof of every path first
    assert r.stdout.rstrip().splitlines()[-1].startswith('== GPU check done in ')
