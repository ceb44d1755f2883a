"""The suite's device rule and its tiers.

- **Default** (`python -m pytest -q tests`): CUDA is hidden (`CUDA_VISIBLE_DEVICES=''`, set before torch first asks for a
  device, and inherited by every process a test starts), so the suite means on a GPU machine exactly what it means on
  CI's CPU machine. Tests marked `gpu` are skipped, with the reason.
- **GPU tier** (`python -m pytest -q --gpu tests`): CUDA stays visible and only the tests marked `gpu` run, each the
  CUDA twin of a CPU test (most are the CPU test's `device='cuda'` parameter). Without a GPU they skip with the reason.
- **Threads**: every test runs with one torch thread (`THREADS`), however the suite is started (serial, `-n N`, one file,
  one test, an IDE), set here and nowhere else: `OMP_NUM_THREADS` for the processes a test starts, `torch.set_num_threads`
  before each test (a test about threads sets its own, and the next test gets the suite's count back). `--threads N` runs
  the whole suite at N threads, to check that no assertion holds at one thread count only.
- **Workers** (`-n N`): each module runs on one worker (xdist's `loadscope`, set here), so a module's expensive fixture (a
  finished study, an uninterrupted reference run) is made once per suite. xdist's `loadgroup` cannot do it under pytest 9:
  its group suffix no longer reaches the node ids, so every group was split across the workers and each worker made the
  fixture again, or made it twice when a module-scoped fixture was torn down between its tests. Modules marked
  `xdist_group` (a costly shared fixture) start first.
- **Quick tier** (`python -m pytest -q -m "not slow" tests`): every module, without the end-to-end, subprocess,
  multi-process, compiling and Penn Treebank tests (marked `slow`); a few minutes on 2 cores.
- **Time is a budget**: a test that takes more than `LONG_S` seconds says why in its docstring; the run ends by naming
  those that took longer without one (it does not fail: times move with the machine).
"""
import os
import pytest

THREADS = 1   # the suite's one thread count: a test's reductions run in the same order serially, under -n N, alone or in an IDE

def pytest_addoption(parser):
    parser.addoption('--gpu', action='store_true',
                     help="run the GPU tier only (the tests marked gpu), with CUDA visible; without it CUDA is hidden from the suite")
    parser.addoption('--threads', type=int, default=THREADS, metavar='N',
                     help=f"torch threads of every test and of the processes tests start (default {THREADS}, however the suite is run)")

def suite_threads(config) -> int:
    n = config.getoption('--threads')
    if n < 1: raise pytest.UsageError(f"--threads must be at least 1, got {n}")
    return n

def pytest_configure(config):
    if not config.getoption('--gpu'): os.environ['CUDA_VISIBLE_DEVICES'] = ''   # before any test module imports torch
    if True:   # the plan's ledger of compiled steps, one per process of the suite, empty: a test's compile decision is the same on any machine
        import tempfile
        os.environ['RNN_DARTS_COMPILE_LEDGER'] = os.path.join(tempfile.mkdtemp(prefix='rnn_darts_ledger_'), 'compiled.json')
    os.environ['OMP_NUM_THREADS'] = str(suite_threads(config))   # whatever the shell had: inherited by the workers and every process a test starts
    if getattr(config.option, 'dist', None) in ('load', 'loadgroup'): config.option.dist = 'loadscope'   # -n N: a module on one worker

def pytest_collection_modifyitems(config, items):
    # the longest work first, so that no worker starts a long module while the other has nothing left: the modules with a
    # costly shared fixture (a test marked xdist_group), then those with slow tests, then the others; whole modules, each
    # in its collected order (loadscope hands a worker a module at a time, in this order)
    tier = lambda it: 0 if it.get_closest_marker('xdist_group') else 1 if it.get_closest_marker('slow') else 2
    module = {}
    for it in items: module[it.module] = min(module.get(it.module, 2), tier(it))
    items.sort(key=lambda it: module[it.module])
    if config.getoption('--gpu'):
        other = [it for it in items if not it.get_closest_marker('gpu')]
        if other: config.hook.pytest_deselected(items=other); items[:] = [it for it in items if it.get_closest_marker('gpu')]
        import torch
        if torch.cuda.is_available(): return
        why = "GPU tier: --gpu was given, but torch.cuda.is_available() is False on this machine"
    else: why = "GPU tier: run with --gpu on a machine with CUDA (python -m pytest --gpu tests)"
    for it in items:
        if it.get_closest_marker('gpu'): it.add_marker(pytest.mark.skip(reason=why))

@pytest.fixture(autouse=True)
def _suite_threads(request):
    "Each test runs at the suite's thread count, and leaves it for the next test and module fixture, whatever it set itself"
    import torch
    torch.set_num_threads(suite_threads(request.config))
    yield
    torch.set_num_threads(suite_threads(request.config))

LONG_S = 20
_long_without_reason = []   # (seconds, test id), gathered where the reports arrive (the controller under -n N)

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if call.when == 'call': rep.user_properties.append(('has_docstring', bool(getattr(getattr(item, 'function', None), '__doc__', None))))

def pytest_runtest_logreport(report):
    if report.when == 'call' and report.duration > LONG_S and not dict(report.user_properties).get('has_docstring', True):
        _long_without_reason.append((report.duration, report.nodeid))

def pytest_terminal_summary(terminalreporter):
    if not _long_without_reason: return
    terminalreporter.section(f"tests over {LONG_S} s without a docstring saying why")
    for d, n in sorted(_long_without_reason, reverse=True): terminalreporter.write_line(f"{d:6.1f}s {n}")
