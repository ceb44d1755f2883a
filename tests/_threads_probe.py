"""Run by `tests/test_suite.py` in a pytest of its own (its name keeps it out of the suite): records the thread count a test
sees, and the one a process it starts inherits"""
import os, json, torch

def test_record_threads():
    with open(os.environ['RNN_DARTS_THREADS_PROBE'], 'w') as f:
        json.dump(dict(torch=torch.get_num_threads(), omp=os.environ.get('OMP_NUM_THREADS')), f)
