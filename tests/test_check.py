"""`rnn-darts check` (`rnn_darts.engine.check`): the matrix of execution paths × cases (α-step kinds × relaxations, SDARTS's
perturbations, random search, a derived cell), each path against its reference on this device; the command's table,
its JSON and its exit status"""
import json, pytest
from rnn_darts.engine import check, plan
from rnn_darts.engine.check import PATHS, StepPath, cases, check_path, tiny_corpus, row_line, run_check, path_named
from rnn_darts.cli import run_command
from rnn_darts.engine import kernels
from rnn_darts.engine.kernels import WeightGroup

@pytest.fixture(autouse=True)
def one_compile_process():
    "Inductor compiles in this process alone: its pool of compile workers would take the cores from the other worker's signal tests"
    import torch._inductor.config as ic
    with ic.patch(compile_threads=1): yield

@pytest.fixture(scope='module')
def shared(tmp_path_factory):
    "The cases' outcomes, by device, computed once and shared by the paths held to the same reference"
    return dict(corpus=tiny_corpus(), outcomes={}, folder=tmp_path_factory.mktemp('check'))

ON_A_CPU = {'graphs': 'equal', 'compiled': 'equal', 'compiled+graphs': 'equal', 'fused': 'refused', 'fused+graphs': 'refused',
            'tf32': 'falls back', 'bf16': 'equal'}   # a CPU emulates the graphs; has no Triton, no TF32

@pytest.mark.parametrize('device', [pytest.param('cpu', marks=pytest.mark.slow), pytest.param('cuda', marks=pytest.mark.gpu)])
@pytest.mark.parametrize('path', PATHS, ids=lambda p: p.name)
def test_every_path_equals_its_reference_on_every_case(path, device, shared, monkeypatch):
    """Each path of the plan on each case it runs: bit for bit where it promises that (graphs), within its limit where it
    does not (compiled, fused, TF32, bf16), or the plan's own refusal or fallback; on a GPU every path must run. On a CPU
    the compiled paths run the derived cell only: with an empty Inductor cache (CI's) the search cell's step variants
    take minutes to compile (4 for them all on 2 cores), and `rnn-darts check` runs them on every case. There they run
    untapped, the graph of small cells; the check's (and CUDA's here) tap their weights as the paper's sizes do. ~45 s on a CPU"""
    compiled_on_cpu = device == 'cpu' and path.asked.get('compile')
    cs = [c for c in cases() if c.name == 'derived DARTS_V2'] if compiled_on_cpu else cases()   # one derived cell: Inductor's cold compile of another takes ~30 s
    if compiled_on_cpu: monkeypatch.setattr(check, 'TAPS_FROM', plan.TAP_MIN_NUMEL)   # the small cells' untapped graph, which the check (tapped, as at the paper's sizes) does not run
    taps = []
    monkeypatch.setattr(WeightGroup, 'taps', lambda self, *a, _taps=WeightGroup.taps: taps.append(1) or _taps(self, *a))
    r = check_path(path, device, cs, shared['corpus'], shared['outcomes'].setdefault(device, {}), shared['folder'])
    assert r['verdict'] == (ON_A_CPU[path.name] if device == 'cpu' else 'equal'), row_line(r)
    if path.asked.get('compile') and r['verdict'] == 'equal': assert bool(taps) != compiled_on_cpu   # which compiled step it proved
    if r['verdict'] == 'equal':
        refusable = ['random search'] if (path.asked.get('compile') or path.asked.get('graphs')) and len(cs) > 1 else []   # it runs another cell each batch
        assert (r['refused'], r['fell_back'], r['cases']) == (refusable, [], len(cs) - len(refusable))   # the fused kernels run gelu too

def test_the_command_prints_its_table_and_writes_json(tmp_path, capsys):
    "What does not run on this machine is said in the table with the plan's reason, and the JSON holds the same rows"
    res = run_command(['check', '--device', 'cpu', '--paths', 'fused,tf32', '--json-path', str(tmp_path/'c.json')])
    out = capsys.readouterr().out
    assert 'fused' in out and "refused: --fuse true runs Triton kernels on a GPU" in out
    assert "falls back: --precision tf32: TF32 is a mode of NVIDIA GPUs' tensor cores" in out
    saved = json.loads((tmp_path/'c.json').read_text())
    assert [r['verdict'] for r in saved['rows']] == ['falls back', 'refused'] and saved['ok'] is True and res['ok']

def test_a_row_says_why_its_cases_were_refused():
    "Cases the plan refuses on a path that ran others: a line per reason, naming them (not only 'the plan's rules')"
    r = dict(path='compiled', cases=3, largest=1e-6, verdict='equal', exact=False, ref='eager', tol=1e-3, off=[], errors=[], why=None,
             refused=['random search', 'x'], refusals={'random search': '--compile true: random search runs another cell every batch', 'x': 'why x'})
    lines = check.row_line(r).splitlines()
    assert lines[1:] == ["    refused for random search: --compile true: random search runs another cell every batch", "    refused for x: why x"]

def test_a_path_that_differs_exits_1_naming_the_case(monkeypatch, capsys):
    "A path whose step is not eager's (another learning rate stands in for a wrong kernel): its row, the case and its difference, one error line, exit 1"
    monkeypatch.setattr(check, 'PATHS', (StepPath('lr', dict(lr=2.5)),))
    monkeypatch.setattr(plan, 'PATH_NAMES', ('lr',))   # the names the command line takes, torch-free
    monkeypatch.setattr(check, 'cases', lambda: [c for c in cases() if c.name == 'first/softmax'])
    with pytest.raises(SystemExit) as e: run_command(['check', '--device', 'cpu', '--paths', 'lr'])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and 'DIFFERS from eager in 1 of its cases' in out and 'first/softmax: differs by' in out
    assert err == 'rnn-darts: error: check: lr differs from its reference (the lines above say where)\n'

def test_bench_times_each_equal_path_and_eager(monkeypatch):
    "--bench: each path that equals its reference gets ms per step as the learner runs it (here at a tiny size), and eager its own"
    monkeypatch.setattr(check, 'cases', lambda: [c for c in cases() if c.name == 'first/softmax'])
    res = run_check('cpu', [path_named('bf16'), path_named('tf32')], bench=True, say=lambda line: None, bench_sizes=dict(bs=3, bptt=4, nhid=8, ntoken=30))
    bf16, tf32 = res['rows']
    assert bf16['verdict'] == 'equal' and bf16['ms'] > 0 and res['eager_ms'] > 0
    assert tf32['verdict'] == 'falls back' and 'ms' not in tf32   # nothing of its own ran

def test_no_path_at_all_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e: run_command(['check', '--paths', ' ,'])
    assert e.value.code == 2 and capsys.readouterr().err.startswith('rnn-darts: error: --paths names no path; paths are graphs, tf32')
