"""The suite means the same however it is run (issue 95): one thread count for every test, serial or under `-n N`,
whatever `OMP_NUM_THREADS` the shell had (`tests/conftest.py` sets it, and nothing else does)"""
import json, os, subprocess, sys
from pathlib import Path
import pytest
import torch

HERE = Path(__file__).resolve().parent

def test_a_test_runs_at_the_suites_thread_count(pytestconfig):
    "The autouse fixture set it (1, or --threads N), whatever the test before this one left"
    from tests.conftest import suite_threads
    n = suite_threads(pytestconfig)
    assert torch.get_num_threads() == n and os.environ['OMP_NUM_THREADS'] == str(n)
    torch.set_num_threads(n + 2)   # the next test gets the suite's count back (the fixture's teardown)

def test_the_next_test_gets_the_count_back(pytestconfig):
    from tests.conftest import suite_threads
    assert torch.get_num_threads() == suite_threads(pytestconfig)

def probe(tmp_path, *args, omp='3') -> dict:
    "The probe's thread counts in a pytest started as a user would, `args` its own, with OMP_NUM_THREADS=`omp` in the shell"
    out = tmp_path/f"threads{len(list(tmp_path.iterdir()))}.json"
    env = {**os.environ, 'OMP_NUM_THREADS': omp, 'RNN_DARTS_THREADS_PROBE': str(out)}
    env.pop('PYTEST_XDIST_WORKER_COUNT', None); env.pop('PYTEST_XDIST_WORKER', None)
    r = subprocess.run([sys.executable, '-m', 'pytest', '-q', *args, str(HERE/'_threads_probe.py')], cwd=HERE.parent, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())

@pytest.mark.slow
def test_serial_and_parallel_runs_give_the_same_thread_count(tmp_path):
    "Serial, under -n 2, and with --threads 2: the thread count comes from the suite, never from the shell's OMP_NUM_THREADS"
    from tests.conftest import THREADS
    want = dict(torch=THREADS, omp=str(THREADS))
    assert probe(tmp_path) == want
    assert probe(tmp_path, '-n', '2') == want
    assert probe(tmp_path, '--threads', '2', omp='1') == dict(torch=2, omp='2')
